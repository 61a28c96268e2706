"""The bundled hybrid-SWA inference worker and its L1 / L2 / L3 prefix cache.

Model side: config (ModelConfig), backend (numpy/cupy), tokenizer (byte-level), weights
(seeded init, .npz / safetensors I/O), model (paged forward + dense reference), kv_pool
(PagePool, DualKVCache, RequestKV). Cache side (kvcache/): cache_manager (the CacheManager
contract), tiered_cache (TieredPrefixCache: the SWA radix tree of swa_tree/ over the device
pools, the tiers of tiers/: host pool and cache, GCache through l3_store, layer-wise loads, MTP
tails; SWA checkpoints in every tier, swa_checkpoints), prefix_cache_off. Serving: request, scheduler, engine, metrics, completions,
engine_thread, worker_flags, http_server (`gcache-worker`, on gcache.serving); publisher
(Redis, for gcache-router); sim_model for benches. See docs/worker-interfaces.md.
"""
