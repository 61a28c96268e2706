"""The worker's model: the hybrid SWA transformer with its paged forward and a dense reference
(transformer), weights (weights), and a cost-only stand-in for benches (sim)."""
