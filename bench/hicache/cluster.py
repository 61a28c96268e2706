"""N real engines sharing one real gcache-server as L3, stepped as a discrete-event
simulation over their virtual clocks (bench/hicache/hierarchy.py's runner).

Each worker is a real Engine (scheduler, SWA radix tree, dual device pools, HostCache +
host pool, L3Store + gcache.Client) with a ScriptedModel and its own VirtualClock.
Events, earliest first: an arrival (delivered to its worker, whose clock moves up to the
arrival time), or one step of the busy worker whose clock is earliest. Every L3 prefetch
and write is waited for in real time as soon as it is queued (BenchTieredCache), so it has
landed before anyone looks: runs are deterministic, and a page written during a step is
visible to a worker whose clock is up to one step behind (the only reordering the
simulation allows).

Arrivals (documented in bench/hicache/hierarchy.py): a seeded Poisson schedule at `rate` requests
per second per worker, in workload order, except that a turn is never sent before the
previous turn of its conversation has finished (closed loop per conversation).
Requests go to workers uniformly at random (seeded), so a conversation's turns usually
land on different workers.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

import gcache
from bench.hicache.sim import BenchTieredCache, CountingClient, ScriptedModel, Timing
from bench.hicache.workloads import Turn, first_turns
from gcache.common.attention import AttentionKind
from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.sim import CostModel, VirtualClock

STUCK_STEPS_MAX = 100


@dataclass(frozen=True)
class Setup:
    """One cache configuration. Byte budgets are per worker (L1, L2) or shared (L3)."""

    name: str
    l2: bool = False
    l3: bool = False
    swa_unaware: bool = False  # SWA KV for every page in every tier (pools split 1:1)
    periodic_checkpoints: bool = True  # Budgets.checkpoint_pages applies (SGLang has none)
    tree_cls: type | None = None


@dataclass(frozen=True)
class Budgets:
    l1_bytes: int
    l2_bytes: int
    l3_bytes: int
    l1_swa_full_ratio: float = 0.25
    l2_swa_full_ratio: float = 0.25
    checkpoint_pages: int = 0


class TierHits:
    """Token hit rates of a run, overall and per tier, and what a run adds to them (needs
    prompt_tokens, hit_by_tier, ttft_s, recomputed, preemptions and makespan_s)."""

    def add_requests(self, reqs) -> None:
        """The finished requests' prompt tokens, hits per tier and TTFTs."""
        for r in reqs:
            self.prompt_tokens += len(r.prompt)
            for tier, n in r.cached_by_tier.items():
                self.hit_by_tier[tier] += n
            self.ttft_s.append(r.ttft_s)

    def add_engines(self, pool) -> None:
        """The workers' prefill tokens computed, preemptions and last virtual time."""
        for w in pool:
            m = w.engine.metrics.snapshot()
            self.recomputed += m["prefill_tokens_computed_total"]
            self.preemptions += m["preemptions_total"]
            self.makespan_s = max(self.makespan_s, w.clock())

    @property
    def hit(self) -> float:
        return sum(self.hit_by_tier.values()) / max(1, self.prompt_tokens)

    def tier_hit(self, tier: str) -> float:
        return self.hit_by_tier[tier] / max(1, self.prompt_tokens)


@dataclass
class RunResult(TierHits):
    setup: str
    workers: int
    prompt_tokens: int = 0
    hit_by_tier: dict = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    ttft_s: list = field(default_factory=list)
    recomputed: int = 0
    l3_distinct_bytes: int = 0
    l3_full_pages: int = 0
    l3_swa_pages: int = 0
    load_s: float = 0.0  # virtual time charged for L2 -> L1 loads (all workers)
    l3_read_s: float = 0.0  # virtual time of L3 prefetches (all workers)
    preemptions: int = 0
    makespan_s: float = 0.0
    wall_s: float = 0.0
    page_size: int = 16

    @property
    def l3_bytes_per_token(self) -> float:
        """Distinct bytes written to L3 per token of the distinct pages written."""
        return self.l3_distinct_bytes / max(1, self.l3_full_pages * self.page_size)


def device_pages(cfg: ModelConfig, setup: Setup, budgets: Budgets) -> tuple[int, int]:
    if setup.swa_unaware:
        n = budgets.l1_bytes // (
            DualKVCache.page_bytes(cfg, AttentionKind.FULL) + DualKVCache.page_bytes(cfg, AttentionKind.SWA)
        )
        return n, n
    return DualKVCache.pages_for_budget(cfg, budgets.l1_bytes, budgets.l1_swa_full_ratio)


class Worker:
    def __init__(
        self,
        cfg: ModelConfig,
        setup: Setup,
        budgets: Budgets,
        sched: SchedulerConfig,
        cost: CostModel,
        timing: Timing,
        l3_address: str,
        max_new_tokens: int,
    ) -> None:
        self.clock = VirtualClock()
        self.model = ScriptedModel(cfg, self.clock, cost, timing)
        full, swa = device_pages(cfg, setup, budgets)
        self.kv = DualKVCache(cfg, full, swa)
        hc = TieredCacheConfig(
            l2_bytes=budgets.l2_bytes if setup.l2 else 0,
            l2_swa_full_ratio=1.0 if setup.swa_unaware else budgets.l2_swa_full_ratio,
            l3_url=l3_address if setup.l3 else "",
            model_name="bench",
            prefetch_policy="wait_complete",
            swa_checkpoint_pages=(
                1 if setup.swa_unaware else budgets.checkpoint_pages if setup.periodic_checkpoints else 0
            ),
        )
        self.client = None
        if setup.l3:
            raw = gcache.Client(
                l3_address, timeout_s=hc.l3_timeout_s, connect_timeout_s=0.5, retries=1, verify_checksums=True
            )
            self.client = CountingClient(
                raw, DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
            )
        self.cache = BenchTieredCache(self.kv, hc, self.clock, timing, l3_client=self.client, tree_cls=setup.tree_cls)
        ec = EngineConfig(max_prompt_tokens=1 << 20, max_new_tokens=max_new_tokens, scheduler=sched, cache_config=hc)
        self.engine = Engine(self.model, self.kv, ec, clock=self.clock, cache=self.cache)
        self.model.attach(self.engine)
        self.wake_s = 0.0
        self.stuck = 0

    def next_s(self) -> float:
        return max(self.clock(), self.wake_s)

    def submit(self, turn: Turn, at_s: float):
        """`turn` arrives at virtual time at_s: its request on this engine, answer scripted."""
        self.clock.advance_to(at_s)
        self.wake_s = max(self.wake_s, at_s)
        r = self.engine.add_request(turn.prompt, SamplingParams(max_tokens=turn.max_tokens, temperature=0.0))
        r.arrival_s = at_s
        if len(turn.answer):
            self.model.answers[r.rid] = turn.answer
        return r

    def finish(self, r, turn: Turn) -> None:
        """Request r of `turn` ended: drop its script, and fail unless it generated exactly that."""
        self.model.answers.pop(r.rid, None)
        if len(turn.answer) and not np.array_equal(r.output, turn.answer):
            raise RuntimeError(f"request {r.rid} generated {r.output[:8]}..., not its scripted answer")

    def step(self) -> list:
        self.clock.advance_to(self.wake_s)
        finished = self.engine.step()
        self.cache.wait_l3()
        if self.engine.last_step_ran:
            self.stuck = 0
            return finished
        t = self.cache.next_ready_s(self.engine.scheduler.waiting)
        if t is not None and t > self.clock():
            self.wake_s = t
            self.stuck = 0
        else:
            self.stuck += 1
            if self.stuck > STUCK_STEPS_MAX:
                raise RuntimeError(
                    f"worker makes no progress: {self.engine.scheduler.waiting[:3]}, {self.cache.stats()}"
                )
        return finished

    def close(self) -> None:
        self.engine.close()


def next_events(heap: list, pool: list) -> tuple[float, float, int]:
    """The next arrival's virtual time (heap of (time, turn)), and the earliest time a worker
    with work can step and its index; inf (and -1) for none."""
    ta = heap[0][0] if heap else float("inf")
    busy = [(w.next_s(), k) for k, w in enumerate(pool) if w.engine.has_work()]
    te, k = min(busy) if busy else (float("inf"), -1)
    return ta, te, k


def simulate(
    turns: list[Turn],
    cfg: ModelConfig,
    setup: Setup,
    budgets: Budgets,
    workers: int,
    sched: SchedulerConfig,
    cost: CostModel,
    timing: Timing,
    l3_address: str,
    rate_per_worker: float,
    seed: int,
    check_every: int = 0,
    inspect=None,
) -> RunResult:
    """Run every turn through `workers` engines; returns the figures of the run.
    `inspect(workers)` is called at the end, before the engines close."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    scheduled = np.cumsum(rng.exponential(1.0 / (rate_per_worker * workers), len(turns)))
    assign = rng.integers(workers, size=len(turns))
    heap, next_turns = first_turns(turns, scheduled)
    max_new = max(t.max_tokens for t in turns)
    pool = [Worker(cfg, setup, budgets, sched, cost, timing, l3_address, max_new) for _ in range(workers)]
    res = RunResult(setup.name, workers, page_size=cfg.page_size)
    index_of: dict[int, int] = {}
    reqs = []
    steps = 0
    try:
        while True:
            ta, te, k = next_events(heap, pool)
            if ta == te == float("inf"):
                break
            if ta <= te:
                _, i = heapq.heappop(heap)
                r = pool[int(assign[i])].submit(turns[i], ta)
                index_of[r.rid] = i
                reqs.append(r)
                continue
            w = pool[k]
            for r in w.step():
                w.finish(r, turns[index_of[r.rid]])
                for j in next_turns.get(index_of[r.rid], ()):
                    heapq.heappush(heap, (max(float(scheduled[j]), r.finished_s), j))
            steps += 1
            if check_every and steps % check_every == 0:
                w.engine.check_integrity()
        for w in pool:
            w.engine.check_integrity()
        if inspect is not None:
            inspect(pool)
    finally:
        for w in pool:
            w.close()
    res.add_requests(reqs)
    res.add_engines(pool)
    for w in pool:
        res.load_s += w.model.load_s
        res.l3_read_s += w.cache.l3_read_s
    # Distinct L3 pages over all workers (two workers may write the same page).
    clients = [w.client for w in pool if w.client is not None]
    res.l3_full_pages = len(set().union(*(c.keys["full"] for c in clients))) if clients else 0
    res.l3_swa_pages = len(set().union(*(c.keys["swa"] for c in clients))) if clients else 0
    res.l3_distinct_bytes = res.l3_full_pages * DualKVCache.page_bytes(
        cfg, AttentionKind.FULL
    ) + res.l3_swa_pages * DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    res.wall_s = time.perf_counter() - t0
    return res
