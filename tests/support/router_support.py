"""What the router tests share: tiny real engines, chat turns, and a driver that runs the
publisher's step hook after every engine step (as EngineThread.add_step_hook does)."""

from __future__ import annotations

import numpy as np

from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from tests.support.tiered_cache_support import CFG

PS, W = CFG.page_size, CFG.window
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def engine(model, full_pages: int = 96, swa_pages: int = 48, l2_bytes: int = 0, **cache_kw) -> Engine:
    """A tiny engine (small steps and chunks, so prefills span several steps); close it."""
    sc = SchedulerConfig(max_tokens_per_step=64, chunk_tokens=24, max_running=4, dedup_min_tokens=16)
    hc = TieredCacheConfig(l2_bytes=l2_bytes, model_name="router-test", **cache_kw)
    ec = EngineConfig(max_prompt_tokens=400, max_new_tokens=64, scheduler=sc, cache_config=hc)
    return Engine(model, DualKVCache(CFG, full_pages, swa_pages), ec)


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 250, size=n)]


def run(eng, prompts, publisher=None, params=GREEDY, steps_max: int = 5000, after_step=None) -> list:
    """Submit prompts, step until idle, calling the publisher's hook after every step."""
    reqs = [eng.add_request(p, params) for p in prompts]
    for _ in range(steps_max):
        if not eng.has_work():
            break
        eng.step()
        if publisher is not None:
            publisher.on_step(eng)
        if after_step is not None:
            after_step()
    else:
        raise RuntimeError("engine still busy")
    if publisher is not None:
        publisher.on_step(eng)
    return reqs


def history(req) -> list[int]:
    """A finished request's prompt + answer: the start of its next turn."""
    return [int(t) for t in req.prompt] + list(req.output)


class ManualClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
