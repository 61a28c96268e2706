"""Store benches: one gcache-server's data path (auth, shm copy kernels, device memory) and its
eviction policies on real traces."""
