"""The worker's prefix cache across tiers: the CacheManager contract (cache_manager) with the
tiered cache (tiered_cache: TieredPrefixCache, coordinating the tiers; its config in
tiered_config, its write / prefetch rules in policies, its SWA checkpoint policy in
swa_checkpoints, its counters in cache_stats) and the no-cache manager (prefix_cache_off);
device pools (kv_pool); the L1 index (swa_tree/); the tiers below the device (tiers/: host
pool and cache, L3 store, layer-wise loads, MTP tails); and what a router needs to know of it
(cache_events)."""
