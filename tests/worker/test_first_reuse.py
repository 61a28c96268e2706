"""The first reuse of a shared prefix hits (issue 19): A = S + q1 then B = S + q2 on an idle
engine. The SWA pages A leaves behind its window stay in the tree as spare pages while the
pool has room, so B finds a window-safe point at S's end; under SWA pressure they go first
and the behaviour is the one without the fix (B misses). Integrity after every step."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import dataclasses

import numpy as np
import pytest

from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.transformer import Model
from tests.support.tiny_model import tiny_config

CFG = tiny_config(dtype="float64")
PS, W = CFG.page_size, CFG.window
S_LEN = 450  # the report had 1450 tokens; 450 (also 2 past a page end, > 256-token chunk + window) is the same case, a third of the steps
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CFG)


def engine(model, swa_pages: int, keep_spare: bool = True, prefix_cache: bool = True) -> Engine:
    sc = SchedulerConfig(max_tokens_per_step=256, chunk_tokens=256, max_running=4)
    hc = dataclasses.replace(TieredCacheConfig(), swa_keep_spare=keep_spare)
    ec = EngineConfig(
        max_prompt_tokens=2048, max_new_tokens=64, prefix_cache=prefix_cache, scheduler=sc, cache_config=hc
    )
    return Engine(model, DualKVCache(CFG, 600, swa_pages), ec)


def serve(e: Engine, prompts) -> list:
    """One request at a time (an idle worker between them), integrity after every step."""
    out = []
    for p in prompts:
        r = e.add_request(p, GREEDY)
        while e.has_work():
            e.step()
            e.check_integrity()
        out.append(r)
    return out


def prompts():
    rng = np.random.default_rng(19)
    s = [int(t) for t in rng.integers(3, 500, size=S_LEN)]
    return s, [s + list(range(20, 40)), s + list(range(40, 55))]  # questions of 20 and 15 tokens


def test_first_reuse_hits_the_shared_prefix_on_an_idle_engine(model):
    s, ps = prompts()
    a, b = serve(engine(model, swa_pages=600), ps)
    assert a.cached_tokens == 0
    assert b.cached_tokens == S_LEN // PS * PS  # S's last whole page: the window-safe length
    before_fix = serve(engine(model, swa_pages=600, keep_spare=False), ps)
    assert [r.cached_tokens for r in before_fix] == [0, 0]  # the miss the issue reports
    plain = serve(engine(model, swa_pages=600, prefix_cache=False), ps)
    assert [r.output for r in (a, b)] == [r.output for r in before_fix] == [r.output for r in plain]


def test_spare_pages_go_first_and_checkpoints_stay(model):
    s, ps = prompts()
    e = engine(model, swa_pages=600)
    serve(e, ps[:1])
    tree = e.tree
    _, swa = tree.cached_pages()
    spare = tree.spare_pages()
    assert spare > 0 and swa - spare <= 2 * (W // PS + 1)  # checkpoints: the ends' window tails
    assert tree.evict(0, spare) == (0, spare)
    assert tree.spare_pages() == 0
    e.check_integrity()
    again, other = serve(e, [ps[0][:-1] + [99], ps[1]])
    assert again.cached_tokens == (len(ps[0]) - 1) // PS * PS  # A's prompt-end checkpoint is kept
    assert other.cached_tokens == 0  # S's end was only spare: gone, as before the fix


def test_under_swa_pressure_the_behaviour_is_the_one_before_the_fix(model):
    """A, then an unrelated C of the same length, then B: with the smallest SWA pool C's
    prefill needs every spare page A left (B misses, as before the fix); with room B hits."""
    s, (a, b) = prompts()
    c = [int(t) for t in np.random.default_rng(7).integers(3, 500, size=len(a))]
    small = -(-(W + 256) // PS) + 4  # the least SWA pool the engine accepts
    fixed = serve(engine(model, swa_pages=small), [a, c, b])
    before = serve(engine(model, swa_pages=small, keep_spare=False), [a, c, b])
    assert [r.cached_tokens for r in fixed] == [r.cached_tokens for r in before] == [0, 0, 0]
    assert [r.output for r in fixed] == [r.output for r in before]
    roomy = serve(engine(model, swa_pages=600), [a, c, b])
    assert [r.cached_tokens for r in roomy] == [0, 0, S_LEN // PS * PS]
    assert [r.output for r in roomy] == [r.output for r in fixed]
