"""What an engine holds, announced to the routers: one home for every producer (the worker's
publisher, the vLLM translator, the L3 subscriber) and the routers that read it."""
