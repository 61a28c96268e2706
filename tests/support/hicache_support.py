"""What the hierarchy tests share: a tiny float64 hybrid model and an engine builder."""

from __future__ import annotations

from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.hicache_config import HiCacheConfig
from gcache.worker.kvcache.kv_pool import DualKVCache

# One full-attention layer among three SWA ones, so both pools (and both L3 keys) carry bytes.
CFG = ModelConfig(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    window=32,
    page_size=8,
    vocab_size=512,
    dtype="float64",
    layer_pattern=("swa", "full", "swa", "swa"),
)


def build_engine(model, full_pages: int, swa_pages: int, hicache: HiCacheConfig, prefix_cache: bool = True) -> Engine:
    """An engine with small steps and chunks (so prefills span several steps); close it."""
    sc = SchedulerConfig(max_tokens_per_step=64, chunk_tokens=24, max_running=4, dedup_min_tokens=16)
    ec = EngineConfig(
        max_prompt_tokens=400, max_new_tokens=64, prefix_cache=prefix_cache, scheduler=sc, hicache=hicache
    )
    return Engine(model, DualKVCache(CFG, full_pages, swa_pages), ec)
