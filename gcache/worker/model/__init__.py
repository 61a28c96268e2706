"""The worker's model: the hybrid SWA transformer with its paged forward and a dense reference
(transformer), weights (weights), a cost-only stand-in for benches (sim), and the contract
the engine steps them by (base.BatchModel)."""
