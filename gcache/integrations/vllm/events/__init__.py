"""GCache's L3 as vLLM KV events: what the connector's scheduler side announces, its ZMQ
publisher and their setup from the connector's settings (docs/kv-events.md)."""
