"""The bundled hybrid-SWA inference worker (issue 4).

Modules: config (ModelConfig), backend (numpy/cupy), tokenizer (byte-level),
weights (seeded init, .npz / safetensors I/O), model (paged forward + dense
reference), kv_pool (PagePool, DualKVCache, RequestKV). The prefix tree, engine,
scheduler and HTTP server live in their own modules; see docs/worker-interfaces.md.
"""
