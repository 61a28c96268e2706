"""What an engine holds, announced to the routers: one home for every producer (the worker's
publisher, the vLLM translator, the L3 subscriber) and the routers that read it.

  wire      the KV-event format (vLLM 0.32's), encode and decode, its constants
  engines   the registration's engine object and EngineKind
  writer    the one Redis writer: registration, engine object, page deltas, stream, L3 view
  l3_view   how the shared L3 view's adds and removals are queued
  bridge    the one loop: direct mode (the worker's publisher), ZMQ mode (the ingest)
"""
