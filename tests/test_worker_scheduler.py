"""TTFT scheduler and FCFS: ordering, budgets, buckets, aging, dedup, bounds."""
from __future__ import annotations

import numpy as np
import pytest

from gcache.worker.config import ModelConfig
from gcache.worker.engine import Engine, EngineConfig
from gcache.worker.kv_pool import DualKVCache
from gcache.worker.request import Request, SamplingParams
from gcache.worker.scheduler import QueueFullError, Scheduler, SchedulerConfig, shared_prefix_len
from gcache.worker.sim_model import SimulatedModel, VirtualClock

P = SamplingParams(max_tokens=4, temperature=0.0)


def req(n: int, arrival: float, base: int = 0) -> Request:
    return Request([(base + i) % 250 for i in range(n)], P, arrival)


def sched(**kw) -> Scheduler:
    cfg = SchedulerConfig(**{"max_tokens_per_step": 256, "chunk_tokens": 128, "long_threshold_tokens": 100,
                             "max_running": 8, **kw})
    return Scheduler(cfg, lambda r: r.num_tokens)


def test_fcfs_plans_in_arrival_order_until_the_budget_is_spent():
    s = sched(policy="fcfs")
    a, b, c = req(300, 0.0), req(10, 1.0, 1), req(20, 2.0, 2)
    for r in (a, b, c):
        s.submit(r)
    plan = s.plan(now=3.0, budget=256)  # chunk_tokens each, then the leftover in order
    assert [(ch.req, ch.tokens) for ch in plan] == [(a, 128 + 98), (b, 10), (c, 20)]
    plan = s.plan(now=3.0, budget=130)
    assert [(ch.req, ch.tokens) for ch in plan] == [(a, 128), (b, 2)]


def test_ttft_puts_the_fewest_uncached_tokens_first_and_reserves_the_short_bucket():
    s = sched(policy="ttft", aging_tokens_per_s=0.0, short_share=0.5)
    long_, short1, short2 = req(1000, 0.0), req(30, 1.0, 1), req(60, 2.0, 2)
    for r in (long_, short1, short2):
        s.submit(r)
    plan = s.plan(now=3.0, budget=256)
    assert [ch.req for ch in plan] == [short1, short2, long_]
    # Short bucket 128: 30 + 60; long bucket 128; the 38 short tokens left flow to the long one.
    assert [ch.tokens for ch in plan] == [30, 60, 128 + 38]
    # The short bucket is a reservation, not a cap: with only long work it takes all of it.
    s2 = sched(policy="ttft", aging_tokens_per_s=0.0, chunk_tokens=256)
    s2.submit(req(1000, 0.0))
    assert [ch.tokens for ch in s2.plan(now=1.0, budget=256)] == [256]


def test_short_bucket_keeps_short_requests_moving_behind_an_aged_long_one():
    s = sched(policy="ttft", aging_tokens_per_s=1100.0, chunk_tokens=256, short_share=0.25)
    long_, short = req(2000, 0.0), req(80, 1.9, 1)
    s.submit(long_)
    s.submit(short)
    plan = s.plan(now=2.0, budget=256)  # aged: 2000 - 2200 < 80 - 110
    assert [ch.req for ch in plan] == [long_, short]
    assert dict((ch.req.rid, ch.tokens) for ch in plan) == {long_.rid: 192, short.rid: 64}


def test_max_wait_moves_a_request_to_the_fcfs_lane():
    s = sched(policy="ttft", aging_tokens_per_s=0.0, max_wait_s=5.0)
    old_long, fresh_short = req(1000, 0.0), req(10, 4.0, 1)
    s.submit(old_long)
    s.submit(fresh_short)
    assert s.plan(now=4.5, budget=256)[0].req is fresh_short
    assert s.plan(now=5.0, budget=256)[0].req is old_long


def test_waiting_queue_is_bounded_and_admissions_respect_max_running():
    s = sched(max_waiting=3, max_running=2)
    for i in range(3):
        s.submit(req(10, float(i), i))
    with pytest.raises(QueueFullError):
        s.submit(req(10, 9.0))
    assert len(s.plan(now=10.0, budget=256)) == 2


def test_in_flight_prefix_is_not_computed_twice():
    s = sched(policy="ttft", aging_tokens_per_s=0.0, dedup_min_tokens=32, max_wait_s=10.0)
    a, b, other = req(200, 0.0), req(210, 0.5), req(50, 0.6, 7)  # b shares a's first 200 tokens
    assert shared_prefix_len(a.prompt, b.prompt) == 200
    for r in (a, b, other):
        s.submit(r)
    planned = [ch.req for ch in s.plan(now=1.0, budget=256)]
    assert a in planned and other in planned and b not in planned
    assert b in [ch.req for ch in s.plan(now=10.5, budget=256)]  # the dedup hold is bounded too


@pytest.mark.parametrize("kw, msg", [
    ({"policy": "lifo"}, "policy must be one of"),
    ({"max_waiting": 0}, "max_waiting must be >= 1"),
    ({"max_running": 600, "max_tokens_per_step": 512}, "max_running must be <="),
    ({"short_share": 1.5}, "short_share must be in"),
    ({"max_wait_s": 0}, "max_wait_s"),
])
def test_config_rejects_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SchedulerConfig(**kw)


# ---- the scheduler inside the real engine (simulated compute, virtual clock) ------------------
CFG = ModelConfig(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, window=32,
                  page_size=8, vocab_size=512)


def sim_engine(policy: str, full_pages=512, swa_pages=256, **kw) -> tuple[Engine, VirtualClock]:
    clock = VirtualClock()
    sc = SchedulerConfig(policy=policy, max_tokens_per_step=128, chunk_tokens=64, max_running=8,
                         long_threshold_tokens=100, **kw)
    return Engine(SimulatedModel(CFG, clock), DualKVCache(CFG, full_pages, swa_pages),
                  EngineConfig(scheduler=sc), clock=clock), clock


def test_no_starvation_under_a_stream_of_short_requests():
    eng, clock = sim_engine("ttft", aging_tokens_per_s=100.0, max_wait_s=0.5)
    long_ = eng.add_request(list(range(1, 250)) * 2, P)
    rng = np.random.default_rng(0)
    shorts = []
    for step in range(3000):  # a short request every step: long is never the shortest
        shorts.append(eng.add_request(list(rng.integers(0, 500, size=20)), P))
        eng.step()
        if long_.is_finished:
            break
    assert long_.is_finished, "the long request starved"
    assert long_.ttft_s < 0.5 + 2.0  # max_wait plus its own prefill, in virtual seconds


def test_dedup_turns_the_second_shared_prompt_into_a_cache_hit():
    eng, clock = sim_engine("ttft", dedup_min_tokens=16)
    shared = [int(t) for t in np.random.default_rng(3).integers(0, 500, size=300)]
    a = eng.add_request(shared + [1, 2, 3], P)
    b = eng.add_request(shared + [4, 5, 6], P)
    eng.run_until_idle(on_step=eng.check_integrity)
    assert a.cached_tokens == 0
    assert b.cached_tokens >= 280  # b waited for a's prefill and reused it
    fcfs, _ = sim_engine("fcfs")
    a2 = fcfs.add_request(shared + [1, 2, 3], P)
    b2 = fcfs.add_request(shared + [4, 5, 6], P)
    fcfs.run_until_idle(on_step=fcfs.check_integrity)
    assert a2.cached_tokens == b2.cached_tokens == 0  # FCFS computes the shared prefix twice


def test_token_slice_matches_the_full_sequence():
    r = req(10, 0.0)
    r.output = [300, 301, 302]
    full = list(r.tokens())
    assert full == list(range(10)) + [300, 301, 302]
    for a in range(14):
        for b in range(a, 14):
            assert list(r.token_slice(a, b)) == full[a:b]


def test_srpt_grants_let_the_head_of_the_queue_finish_instead_of_sharing_the_step():
    a, b, c = req(150, 0.0), req(400, 0.1, 1), req(300, 0.2, 2)  # all long (> 100 tokens)
    plans = {}
    for srpt in (True, False):
        s = sched(policy="ttft", aging_tokens_per_s=0.0, chunk_tokens=64, srpt_chunks=srpt)
        for r in (a, b, c):
            s.submit(r)
        plans[srpt] = [(ch.req, ch.tokens) for ch in s.plan(now=1.0, budget=256)]
    assert plans[True] == [(a, 150), (c, 106)]            # a's prefill completes this step
    assert plans[False] == [(a, 64 + 64), (c, 64), (b, 64)]  # everyone moves, nobody finishes


def test_a_prefill_that_others_wait_for_outranks_shorter_work():
    """Smith's rule: the leader of held-back followers ranks by need / (1 + followers)."""
    doc = [int(t) for t in np.random.default_rng(5).integers(0, 500, size=400)]
    fresh = [int(t) for t in np.random.default_rng(6).integers(0, 500, size=200)]
    for followers in (0, 3):
        eng, clock = sim_engine("ttft", aging_tokens_per_s=0.0, dedup_min_tokens=16)
        leader = eng.add_request(doc + [1], P)
        eng.step()  # leader admitted, 128 of its 401 tokens computed (alone: the whole step)
        assert leader.to_compute == 401 - 128
        held = [eng.add_request(doc + [2 + i], P) for i in range(followers)]
        other = eng.add_request(fresh, P)  # 200 uncached: shorter than the leader's 273
        plan = [ch.req for ch in eng.scheduler.plan(clock(), 128)]
        assert not set(held) & set(plan)  # followers wait for the leader's prefill
        assert plan[0] is (leader if followers else other)
        eng.run_until_idle(on_step=eng.check_integrity)
        assert all(h.cached_tokens >= 400 - 16 for h in held)


@pytest.mark.parametrize("max_wait_s", [0.05, 30.0])
def test_short_requests_are_not_starved_by_a_stream_of_long_ones(max_wait_s):
    """A long prompt arrives every step (and, with a small max_wait_s, they age into the
    FCFS lane ahead of everyone); every short prompt still gets its first token within
    two steps of arriving: the short bucket keeps budget for it and short_slots a running
    slot (without that, aged longs filled every slot and shorts waited 29+ steps)."""
    eng, clock = sim_engine("ttft", aging_tokens_per_s=5000.0, max_wait_s=max_wait_s,
                            full_pages=4096, swa_pages=1024)
    rng = np.random.default_rng(1)
    shorts, steps_to_first = [], {}
    for step in range(120):
        eng.add_request([int(t) for t in rng.integers(0, 500, size=300)], P)
        if step % 3 == 0:
            shorts.append((eng.add_request([int(t) for t in rng.integers(0, 500, size=20)], P), step))
        eng.step()
        for r, arrived in shorts:
            if r.first_token_s is not None and r.rid not in steps_to_first:
                steps_to_first[r.rid] = step + 1 - arrived
    assert len(eng.scheduler.waiting) > 20  # the longs really queue up
    # One step, or two when the previous short's decode still holds the kept slot.
    assert max(steps_to_first.values()) <= 2
    assert len(steps_to_first) == len(shorts)
    eng.run_until_idle(on_step=eng.check_integrity)


def test_cost_model_features_and_the_dense_swa_band():
    from gcache.worker.sim_model import CostModel
    f, W = 2 / 14, 128
    chunks = [(1, 1000), (256, 300)]  # a decode at context 1000, a 256-token chunk ending at 300
    banded = CostModel().features(chunks, f, W)
    dense = CostModel(swa_dense=True).features(chunks, f, W)
    assert banded[:3] == dense[:3] == (1.0, 257.0, 2.0)
    assert banded[3] == pytest.approx(1 * (f * 1000 + (1 - f) * 128) + 256 * (f * 300 + (1 - f) * 128))
    assert dense[3] == pytest.approx(1 * (f * 1000 + (1 - f) * 129) + 256 * (f * 300 + (1 - f) * 300))
    assert banded[4] == dense[4] == pytest.approx(f * 1000 + (1 - f) * 129 + f * 300 + (1 - f) * 300)
    c = CostModel(base_s=1.0, token_s=2.0, req_s=3.0, kv_s=4.0, read_s=5.0)
    assert c.cost_s((1, 10, 100, 1000, 10000)) == 1 + 20 + 300 + 4000 + 50000
    # The defaults keep the original formula: no per-sequence or key-read term.
    assert CostModel().cost_s(banded) == pytest.approx(0.004 + 40e-6 * 257 + 4e-9 * banded[3])
