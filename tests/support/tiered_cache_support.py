"""What the hierarchy tests share: a tiny float64 hybrid model and an engine builder."""

from __future__ import annotations

from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from tests.support.tiny_model import ONE_FULL_LAYER, tiny_config

CFG = tiny_config(dtype="float64", layer_pattern=ONE_FULL_LAYER)


def build_engine(
    model, full_pages: int, swa_pages: int, cache_config: TieredCacheConfig, prefix_cache: bool = True
) -> Engine:
    """An engine with small steps and chunks (so prefills span several steps); close it."""
    sc = SchedulerConfig(max_tokens_per_step=64, chunk_tokens=24, max_running=4, dedup_min_tokens=16)
    ec = EngineConfig(
        max_prompt_tokens=400, max_new_tokens=64, prefix_cache=prefix_cache, scheduler=sc, cache_config=cache_config
    )
    return Engine(model, DualKVCache(CFG, full_pages, swa_pages), ec)
