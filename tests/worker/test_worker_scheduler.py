"""The two scheduling policies: one shared budgeting and dedup, two orders; bounds; exactness."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import math

import numpy as np
import pytest

from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import Request, RequestState, SamplingParams
from gcache.worker.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig, shared_prefix_len
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.model.sim import CostModel, SimulatedModel, VirtualClock
from gcache.worker.model.transformer import Model
from tests.support.tiny_model import tiny_config

P = SamplingParams(max_tokens=4, temperature=0.0)
POLICIES = ("fcfs", "ttft")


def req(n: int, arrival: float, base: int = 0) -> Request:
    return Request([(base + i) % 250 for i in range(n)], P, arrival)


def sched(**kw) -> Scheduler:
    cfg = SchedulerConfig(**{"max_tokens_per_step": 256, "chunk_tokens": 256, "max_running": 8, **kw})
    return Scheduler(cfg, lambda r: r.num_tokens)


def plan_of(s: Scheduler, now: float, budget: int) -> list[tuple[Request, int]]:
    return [(ch.req, ch.tokens) for ch in s.plan(now=now, budget=budget)]


# ---- the shared budgeting -----------------------------------------------------------------------
def test_fcfs_gives_the_oldest_request_the_whole_step_then_the_next():
    s = sched(policy="fcfs", max_tokens_per_step=512, chunk_tokens=512)
    a, b, c = req(300, 0.0), req(10, 1.0, 1), req(20, 2.0, 2)
    for r in (a, b, c):
        s.submit(r)
    assert plan_of(s, 3.0, 256) == [(a, 256)]  # vLLM / SGLang: no per-request cap
    assert plan_of(s, 3.0, 400) == [(a, 300), (b, 10), (c, 20)]  # what a leaves goes on in order
    assert plan_of(s, 3.0, 305) == [(a, 300), (b, 5)]
    capped = sched(policy="fcfs", chunk_tokens=128)  # a cap (both policies) makes room for the next ...
    for r in (a, b, c):
        capped.submit(r)
    assert plan_of(capped, 3.0, 256) == [(a, 128 + 98), (b, 10), (c, 20)]  # ... and never idles the step


def test_ttft_takes_the_same_budgeting_in_shortest_remaining_work_order():
    s = sched(policy="ttft")
    long_, short1, short2 = req(1000, 0.0), req(30, 1.0, 1), req(60, 2.0, 2)
    for r in (long_, short1, short2):
        s.submit(r)
    assert plan_of(s, 3.0, 256) == [(short1, 30), (short2, 60), (long_, 166)]
    assert plan_of(s, 3.0, 50) == [(short1, 30), (short2, 20)]
    capped = sched(policy="ttft", chunk_tokens=20)
    for r in (long_, short1, short2):
        capped.submit(r)
    assert plan_of(capped, 3.0, 256) == [(short1, 30), (short2, 60), (long_, 166)]  # pass 2 in order
    assert plan_of(capped, 3.0, 100) == [(short1, 30), (short2, 50), (long_, 20)]


def test_when_both_orders_agree_the_plans_are_identical():
    """Arrivals in increasing need: SRPT order == arrival order, so the plans must match
    exactly, chunk for chunk: nothing but the order differs between the policies."""
    rng = np.random.default_rng(0)
    needs = sorted(int(n) for n in rng.integers(1, 400, size=12))
    for budget in (1, 7, 100, 256, 999, 5000):
        plans = {}
        for policy in POLICIES:
            s = sched(policy=policy, max_running=6, chunk_tokens=200)
            for i, n in enumerate(needs):
                s.submit(req(n, float(i), 17 * i))
            plans[policy] = [(ch.req.rid - s.waiting[0].rid, ch.tokens) for ch in s.plan(now=20.0, budget=budget)]
        assert plans["fcfs"] == plans["ttft"], budget


@pytest.mark.parametrize("policy", POLICIES)
def test_every_plan_respects_budget_cap_slots_and_uses_the_whole_step(policy):
    """Random queues (running prefills + waiting requests): a plan never exceeds the budget
    or a request's need, admits no more than the free slots, names no request twice, gives
    more than chunk_tokens to a request only once everyone planned got chunk_tokens (or all
    they need), and leaves budget unused only when every eligible candidate got all it needs."""
    rng = np.random.default_rng(1)
    for trial in range(200):
        s = sched(
            policy=policy,
            max_running=int(rng.integers(1, 9)),
            chunk_tokens=int(rng.integers(1, 300)),
            max_tokens_per_step=512,
        )
        for i in range(int(rng.integers(0, 12))):
            r = req(int(rng.integers(1, 600)), float(rng.random() * 10), 31 * i + trial)
            s.submit(r)
        running: list = []  # the Batcher's list
        for r in list(s.waiting[: int(rng.integers(0, len(s.waiting) + 1))]):
            if len(running) < s.config.max_running:  # a running prefill, partly computed
                s.waiting.remove(r)
                r.state = RequestState.RUNNING
                running.append(r)
        budget = int(rng.integers(0, 512))
        plan = s.plan(now=10.0 + rng.random() * 40, budget=budget, running=running)
        total = sum(ch.tokens for ch in plan)
        assert total <= budget
        assert len({ch.req.rid for ch in plan}) == len(plan)
        cap = s.config.chunk_tokens
        for ch in plan:
            assert 0 < ch.tokens <= s.need_of(ch.req)
        if any(ch.tokens > cap for ch in plan):
            assert all(ch.tokens >= min(cap, s.need_of(ch.req)) for ch in plan)
        admitted = [ch.req for ch in plan if ch.req.state is RequestState.WAITING]
        assert len(admitted) <= s.config.max_running - len(running)
        if total < budget:  # work-conserving: everyone who could take more got all of it
            free = s.config.max_running - len(running)
            eligible = running + (s.waiting[:free] if free > 0 else [])
            planned = {ch.req.rid: ch.tokens for ch in plan}
            for r in eligible:
                if r.state is RequestState.RUNNING or len(admitted) < free:
                    assert planned.get(r.rid, 0) == s.need_of(r), (trial, r)


def test_waiting_queue_is_bounded_and_admissions_respect_max_running():
    s = sched(max_waiting=3, max_running=2)
    for i in range(3):
        s.submit(req(10, float(i), i))
    with pytest.raises(QueueFullError):
        s.submit(req(10, 9.0))
    assert len(s.plan(now=10.0, budget=256)) == 2


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"policy": "lifo"}, "policy must be one of"),
        ({"max_waiting": 0}, "max_waiting must be >= 1"),
        ({"chunk_tokens": 0}, "chunk_tokens must be >= 1"),
        ({"max_running": 600, "max_tokens_per_step": 512}, "max_running must be <="),
        ({"max_wait_s": 0}, "max_wait_s"),
        ({"aging_tokens_per_s": -1.0}, "aging_tokens_per_s"),
        ({"dedup_min_tokens": 0}, "dedup_min_tokens must be >= 1"),
    ],
)
def test_config_rejects_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SchedulerConfig(**kw)


# ---- ttft ordering: the lane, Smith's rule, groups ----------------------------------------------
def test_max_wait_moves_a_request_to_the_fcfs_lane():
    s = sched(policy="ttft", max_wait_s=5.0)
    old_long, fresh_short = req(1000, 0.0), req(10, 4.0, 1)
    s.submit(old_long)
    s.submit(fresh_short)
    assert s.plan(now=4.5, budget=256)[0].req is fresh_short
    assert s.plan(now=5.0, budget=256)[0].req is old_long


def test_aging_when_enabled_trades_need_against_time_waited():
    """key = need - rate * wait: a long request 400 tokens longer leads once it arrived more
    than 400 / rate seconds earlier; with aging off (the default) the shorter always leads."""
    for rate, short_arrives, first in ((100.0, 3.0, "short"), (100.0, 5.0, "long"), (0.0, 5.0, "short")):
        s = sched(policy="ttft", aging_tokens_per_s=rate)
        long_, short = req(500, 0.0), req(100, short_arrives, 1)
        s.submit(long_)
        s.submit(short)
        assert s.plan(now=6.0, budget=256)[0].req is {"short": short, "long": long_}[first]


@pytest.mark.parametrize("policy", POLICIES)
def test_in_flight_prefix_is_not_computed_twice_under_both_policies(policy):
    s = sched(policy=policy, dedup_min_tokens=32, max_wait_s=10.0)
    a, b, other = req(200, 0.0), req(210, 0.5), req(50, 0.6, 7)  # b shares a's first 200 tokens
    assert shared_prefix_len(a.prompt, b.prompt) == 200
    for r in (a, b, other):
        s.submit(r)
    planned = [r for r, _ in plan_of(s, 1.0, 512)]
    assert a in planned and other in planned and b not in planned
    assert b in [r for r, _ in plan_of(s, 10.5, 512)]  # the hold is bounded by max_wait_s


# ---- the scheduler inside the real engine (simulated compute, virtual clock) -------------------
CFG = ModelConfig(
    layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, window=32, page_size=8, vocab_size=512
)


def sim_engine(policy: str, full_pages=512, swa_pages=256, **kw) -> tuple[Engine, VirtualClock]:
    clock = VirtualClock()
    sc = SchedulerConfig(**{"policy": policy, "max_tokens_per_step": 128, "chunk_tokens": 128, "max_running": 8, **kw})
    return Engine(
        SimulatedModel(CFG, clock), DualKVCache(CFG, full_pages, swa_pages), EngineConfig(scheduler=sc), clock=clock
    ), clock


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 500, size=n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_dedup_turns_the_second_shared_prompt_into_a_cache_hit_under_both_policies(policy):
    eng, _ = sim_engine(policy, dedup_min_tokens=16)
    shared = tokens(3, 300)
    a = eng.add_request(shared + [1, 2, 3], P)
    b = eng.add_request(shared + [4, 5, 6], P)
    eng.run_until_idle(on_step=eng.check_integrity)
    assert (a.cached_tokens, b.cached_tokens) == (0, 296)  # 37 whole pages of the 300 shared tokens
    assert eng.metrics.snapshot()["prefill_tokens_computed_total"] == 303 + 7
    off, _ = sim_engine(policy, dedup_min_tokens=10**9)  # the ablation: both compute it
    a2, b2 = off.add_request(shared + [1, 2, 3], P), off.add_request(shared + [4, 5, 6], P)
    off.run_until_idle(on_step=off.check_integrity)
    assert a2.cached_tokens == 0 and b2.cached_tokens in (0, 296)
    assert off.metrics.snapshot()["prefill_tokens_computed_total"] > 303 + 7


def test_a_prefill_that_others_wait_for_outranks_shorter_work():
    """Smith's rule: the leader of held-back followers ranks by need / (1 + followers)."""
    doc, fresh = tokens(5, 400), tokens(6, 200)
    for followers in (0, 3):
        eng, clock = sim_engine("ttft", dedup_min_tokens=16)
        leader = eng.add_request(doc + [1], P)
        eng.step()  # leader admitted, 128 of its 401 tokens computed (alone: the whole step)
        assert leader.to_compute == 401 - 128
        held = [eng.add_request(doc + [2 + i], P) for i in range(followers)]
        other = eng.add_request(fresh, P)  # 200 uncached: shorter than the leader's 273
        plan = [ch.req for ch in eng.scheduler.plan(clock(), 128, eng.batcher.running)]
        assert not set(held) & set(plan)  # followers wait for the leader's prefill
        assert plan[0] is (leader if followers else other)
        eng.run_until_idle(on_step=eng.check_integrity)
        assert all(h.cached_tokens == 400 for h in held)


def test_waiting_requests_that_share_an_uncached_prefix_rank_as_one_group():
    """A burst of questions on a document not in the tree: the oldest of the group ranks by
    need / group size, the others are held back for it; a lone request of the same length
    does not get that boost."""
    doc, fresh = tokens(7, 400), tokens(8, 250)
    for burst in (1, 3):
        eng, clock = sim_engine("ttft", dedup_min_tokens=16)
        group = [eng.add_request(doc + [10 + i], P) for i in range(burst)]
        other = eng.add_request(fresh, P)  # 250 < 401, but > 401 / 3
        plan = [ch.req for ch in eng.scheduler.plan(clock(), 128, eng.batcher.running)]
        assert plan[0] is (group[0] if burst > 1 else other)
        assert not set(group[1:]) & set(plan)
        eng.run_until_idle(on_step=eng.check_integrity)
        assert [g.cached_tokens for g in group] == [0] + [400] * (burst - 1)


@pytest.mark.slow
def test_a_long_request_is_not_starved_by_a_stream_of_short_ones():
    """Shorts arrive faster than the engine computes them (overload), each shorter than the
    long request: SRPT alone would never run it. The max_wait_s lane admits it within a
    bounded number of steps: every step costs at least CostModel.base_s of virtual time."""
    max_wait_s = 0.5
    eng, clock = sim_engine("ttft", max_wait_s=max_wait_s, full_pages=4096, swa_pages=1024, max_waiting=4096)
    long_ = eng.add_request(tokens(9, 600), P)
    rng = np.random.default_rng(2)
    bound = math.ceil(max_wait_s / CostModel().base_s) + 1
    admitted_at = None
    for step in range(bound + 50):
        for _ in range(3):  # 3 x 60 tokens per step > the 128-token budget
            eng.add_request([int(t) for t in rng.integers(0, 500, size=60)], P)
        eng.step()
        eng.check_integrity()
        if admitted_at is None and long_.admitted_s is not None:
            admitted_at = step
    assert admitted_at is not None and admitted_at <= bound
    assert long_.admitted_s - long_.arrival_s >= max_wait_s  # the lane, not a lull, let it in
    assert long_.first_token_s is not None
    assert len(eng.scheduler.waiting) > 100  # the shorts really did pile up


@pytest.mark.slow
@pytest.mark.parametrize("max_wait_s", [0.05, 30.0])
def test_short_requests_keep_moving_behind_a_stream_of_long_ones(max_wait_s):
    """A long prompt arrives every step; with a small max_wait_s they age into the FCFS lane
    ahead of everyone, so shorts then wait in arrival order (bounded); with a large one, every
    short gets its first token within two steps of arriving (SRPT puts it first)."""
    eng, clock = sim_engine("ttft", max_wait_s=max_wait_s, full_pages=4096, swa_pages=1024)
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
    if max_wait_s == 30.0:
        assert len(steps_to_first) == len(shorts) and max(steps_to_first.values()) <= 2
    eng.run_until_idle(on_step=eng.check_integrity)
    assert all(r.is_finished for r, _ in shorts)


# ---- exactness: the policies change when, never what ---------------------------------------------
MODEL_CFG = tiny_config(dtype="float64")


@pytest.mark.parametrize("policy", POLICIES)
def test_token_outputs_equal_a_no_cache_engine_with_dedup_and_groups_active(policy):
    """Document-QA bursts (dedup holds, groups), fresh prompts, and pools small enough to
    evict: the real model's greedy and sampled tokens equal a run without any prefix cache."""
    model = Model(MODEL_CFG)
    rng = np.random.default_rng(11)
    docs = [[int(t) for t in rng.integers(0, 512, size=n)] for n in (120, 90)]
    script = []
    for i in range(14):
        if i % 3 == 2:
            prompt = [int(t) for t in rng.integers(0, 512, size=int(rng.integers(5, 40)))]
        else:
            prompt = docs[i % 2] + [int(t) for t in rng.integers(0, 512, size=int(rng.integers(2, 9)))]
        script.append(
            (prompt, SamplingParams(max_tokens=int(rng.integers(2, 9)), temperature=[0.0, 0.8][i % 2], seed=i))
        )
    outs = {}
    for cached in (True, False):
        sc = SchedulerConfig(policy=policy, max_tokens_per_step=48, chunk_tokens=48, max_running=4, dedup_min_tokens=16)
        eng = Engine(model, DualKVCache(MODEL_CFG, 48, 20), EngineConfig(prefix_cache=cached, scheduler=sc))
        reqs = []
        for k, (prompt, params) in enumerate(script):
            reqs.append(eng.add_request(prompt, params))
            if k % 4 == 3:
                eng.step()
                eng.check_integrity()
        eng.run_until_idle(on_step=eng.check_integrity)
        outs[cached] = reqs
    assert [r.output for r in outs[True]] == [r.output for r in outs[False]]
    assert sum(r.cached_tokens for r in outs[True]) > 0
    assert sum(r.cached_tokens for r in outs[False]) == 0


def test_token_slice_matches_the_full_sequence():
    r = req(10, 0.0)
    r.output = [300, 301, 302]
    full = list(r.tokens())
    assert full == list(range(10)) + [300, 301, 302]
    for a in range(14):
        for b in range(a, 14):
            assert list(r.token_slice(a, b)) == full[a:b]


def test_cost_model_features_and_the_dense_swa_band():
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


@pytest.mark.parametrize("prompt_len", [1750, 4000])
def test_a_long_prompt_on_the_smallest_swa_pool_runs_without_preempting_itself(prompt_len):
    """The plan's second pass grants a lone prefill the whole step (512 tokens) though the SWA
    pool is sized for a chunk_tokens chunk (256): the chunk shrinks to what the pool holds.
    Preempting the request for the rest threw its progress away every step: a livelock."""
    cfg, clock = ModelConfig(), VirtualClock()
    sc = SchedulerConfig(max_tokens_per_step=512, chunk_tokens=256)
    swa_min = -(-(cfg.window + sc.chunk_tokens) // cfg.page_size) + 4  # the least the engine takes
    ec = EngineConfig(max_prompt_tokens=8192, max_new_tokens=16, scheduler=sc)
    e = Engine(SimulatedModel(cfg, clock), DualKVCache(cfg, 2 * prompt_len // cfg.page_size, swa_min), ec, clock=clock)
    prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(0, 256, prompt_len)]
    r = e.add_request(prompt, SamplingParams(max_tokens=4))
    e.run_until_idle(steps_max=200, on_step=e.check_integrity)
    assert len(r.output) == 4 and r.preemptions == 0
    assert e.metrics.snapshot()["prefill_tokens_computed_total"] == prompt_len
