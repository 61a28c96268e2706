"""The bundled hybrid-SWA inference worker and its L1 / L2 / L3 prefix cache.

Model side: config (ModelConfig), backend (numpy/cupy), tokenizer (byte-level), weights
(seeded init, .npz / safetensors I/O), model (paged forward + dense reference), kv_pool
(PagePool, DualKVCache, RequestKV). Cache side: cache_manager (the CacheManager contract),
hicache (HiCache: the SWA radix tree over the device pools, the host pool of host_pool /
host_cache, GCache through l3_store, layer-wise loads in layer_load, SWA checkpoints in every
tier), prefix_cache_off. Serving: request, scheduler, engine, metrics, completions,
engine_thread, worker_flags, http_server (`gcache-worker`, on gcache.serving); publisher
(Redis, for gcache-router); sim_model for benches. See docs/worker-interfaces.md.
"""
