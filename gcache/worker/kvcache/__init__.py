"""The worker's prefix cache across tiers: device pools (kv_pool), the SWA radix tree
(swa_radix_tree, swa_tree_*), the host pool (host_pool, host_cache), GCache as L3 (l3_store),
layer-wise loads (layer_load), the CacheManager contract (cache_manager) with HiCache
(hicache, with its write / prefetch rules in policies) and the no-cache manager
(prefix_cache_off), and what a router needs to know of it (cache_events)."""
