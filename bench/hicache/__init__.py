"""KV-cache benches: the worker's SWA radix tree and L1/L2/L3 hierarchy (hit rates, TTFT,
KV bytes, layer-wise loading), simulated on a virtual clock or run on real processes."""
