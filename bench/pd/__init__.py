"""Prefill/decode disaggregation benches: `disagg` (2P+2D vs 4 mixed on the fitted clock,
host vs device pre-allocation of handoffs) and `real` (real processes through the router)."""
