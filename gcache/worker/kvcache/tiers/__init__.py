"""The tiers below the device: the L2 host pool (host_pool: page storage and copies; host_cache:
its index, pins, LRU), GCache as L3 (l3_store), layer-wise host -> device loads (layer_load)
and the `mtp` pool of MTP checkpoint tails across tiers (mtp_tails)."""
