"""The tiny hybrid model the worker, hierarchy and bench tests run: 4 layers of 64, window 32,
pages of 8 tokens. `tiny_config(**overrides)` for a variant (dtype, layer pattern)."""

from __future__ import annotations

from gcache.worker.config import ModelConfig

TINY_MODEL = dict(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    window=32,
    page_size=8,
    vocab_size=512,
)
# One full-attention layer among three SWA ones, so both pools (and both L3 keys) carry bytes.
ONE_FULL_LAYER = ("swa", "full", "swa", "swa")


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY_MODEL, **overrides})
