"""The router's ingest wing: engines' event streams into the routers' shared Redis state (the
vLLM KV-event translator, the GCache L3 subscriber, their ZMQ loop). Routing itself never
imports it; `gcache-router`'s command line starts it."""
