"""Which prefill chunks run in the next step: the TTFT policy and FCFS for comparison.

TTFT policy (per step, over running-but-still-prefilling and waiting requests):
  * priority = uncached tokens (counted after prefix matching) - aging_tokens_per_s * wait;
    a request that waited max_wait_s or more jumps to a FCFS lane ahead of everyone, so no
    wait is unbounded; a prefilling request that held-back requests (dedup, below) wait for
    ranks by need / (1 + waiters) (Smith's rule: its prefill serves them all);
  * SRPT grants: in priority order each request takes all it needs (from its bucket) rather
    than chunk_tokens apiece, so the head of the queue finishes instead of every candidate
    sharing each step (processor sharing delays every long prefill to the end);
  * length buckets: while short requests (<= long_threshold_tokens uncached) want tokens,
    short_share of the prefill budget is reserved for them, so a long prefill that aged to
    the front cannot stall them; leftover budget flows to whoever is next; and long requests
    leave short_slots running slots free, or aged long prefills could fill every slot and a
    short request would wait for one of them to finish;
  * in-flight prefix dedup: a waiting request whose uncached part is being computed right
    now by another request is held back (for at most max_wait_s) and gets it as a cache hit
    once that prefill lands in the tree, instead of computing it twice.
FCFS: arrival order, each candidate takes up to chunk_tokens until the budget is spent.
Decodes are not planned here: the engine runs every decode first, then these chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .integrity import require
from .request import Request, RequestState

POLICIES = ("ttft", "fcfs")


class QueueFullError(RuntimeError):
    """The waiting queue is at max_waiting; the caller should retry later (HTTP 503)."""


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "ttft"
    max_waiting: int = 1024          # bound of the waiting queue
    max_running: int = 32            # requests holding KV at once
    max_tokens_per_step: int = 512   # decode tokens + prefill tokens per step
    chunk_tokens: int = 256          # most prefill tokens one request gets per step
    aging_tokens_per_s: float = 2000.0
    max_wait_s: float = 30.0
    long_threshold_tokens: int = 512
    short_share: float = 0.5
    dedup_min_tokens: int = 32       # shared uncached prefix worth waiting for
    estimates_per_step: int = 64     # tree matches spent refreshing stale estimates per step
    scan_max: int = 256              # candidates examined per plan
    short_slots: int = 1             # running slots a long request may not take (capped at max_running - 1)
    srpt_chunks: bool = True         # TTFT: the head of the order takes all it needs (see _grant)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.short_slots < 0:
            raise ValueError("SchedulerConfig.short_slots must be >= 0")
        for name in ("max_waiting", "max_running", "max_tokens_per_step", "chunk_tokens",
                     "long_threshold_tokens", "estimates_per_step", "scan_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1")
        if self.max_running > self.max_tokens_per_step:
            raise ValueError("max_running must be <= max_tokens_per_step (every decode needs a token)")
        if not 0.0 <= self.short_share <= 1.0:
            raise ValueError("short_share must be in [0, 1]")
        if self.aging_tokens_per_s < 0 or self.max_wait_s <= 0:
            raise ValueError("aging_tokens_per_s must be >= 0 and max_wait_s > 0")


@dataclass(frozen=True)
class Chunk:
    req: Request
    tokens: int  # upper bound; a waiting request recomputes its real need at admission


def shared_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Scheduler:
    """Owns the waiting queue (arrival order) and the running list (admission order)."""

    def __init__(self, config: SchedulerConfig, estimate_uncached: Callable[[Request], int]) -> None:
        self.config = config
        self.estimate_uncached = estimate_uncached
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.epoch = 0  # bumped by the engine whenever the tree's contents change
        self._waiters: dict[int, int] = {}  # rid -> waiting requests held back for its prefill

    # ---- queue ops -------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        require(req.state is RequestState.WAITING, f"submit of a {req.state.value} request")
        self.waiting.append(req)

    def requeue(self, req: Request) -> None:
        """A preempted request goes back in arrival order (it may exceed max_waiting by the
        number of running requests, which is bounded by max_running)."""
        require(req.state is RequestState.WAITING and req not in self.waiting, "requeue of a request already queued")
        req.estimate_epoch, req.uncached_estimate = -1, req.num_tokens
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: (r.arrival_s, r.rid))

    def tree_changed(self) -> None:
        self.epoch += 1

    # ---- planning ----------------------------------------------------------------
    def plan(self, now: float, budget: int) -> list[Chunk]:
        """Prefill chunks for this step, in the order the engine should admit/run them."""
        if budget <= 0:
            return []
        prefilling = [r for r in self.running if not r.is_decoding]
        free_slots = self.config.max_running - len(self.running)
        self._refresh_estimates()
        if self.config.policy == "fcfs":
            return self._plan_fcfs(prefilling, budget, free_slots)
        return self._plan_ttft(prefilling, now, budget, free_slots)

    def _plan_fcfs(self, prefilling: list[Request], budget: int, free_slots: int) -> list[Chunk]:
        cands = sorted(prefilling, key=lambda r: (r.arrival_s, r.rid)) + self.waiting[:free_slots]
        return self._grant(cands[: self.config.scan_max], [False] * len(cands), {False: budget, True: 0},
                           srpt=False)

    def _refresh_estimates(self) -> None:
        stale = [r for r in self.waiting if r.estimate_epoch != self.epoch]
        stale.sort(key=lambda r: r.estimate_epoch)  # oldest estimates first
        for r in stale[: self.config.estimates_per_step]:
            r.uncached_estimate = self.estimate_uncached(r)
            r.estimate_epoch = self.epoch

    def need_of(self, r: Request) -> int:
        return r.to_compute if r.state is RequestState.RUNNING else r.uncached_estimate

    def priority(self, r: Request, now: float) -> tuple:
        """Smaller first. need / (1 + waiters) is Smith's rule: a prefill that k held-back
        requests will reuse finishes k + 1 first tokens' worth of work, so it ranks as if it
        were k + 1 times shorter (otherwise a hot document's first reader, being long, ranks
        last and its followers wait behind everyone)."""
        wait = now - r.arrival_s
        if wait >= self.config.max_wait_s:
            return (0, r.arrival_s, r.rid)  # starvation lane: FCFS among the aged
        need = self.need_of(r) / (1 + self._waiters.get(r.rid, 0))
        return (1, need - self.config.aging_tokens_per_s * wait, r.arrival_s, r.rid)

    def _count_waiters(self, prefilling: list[Request], now: float) -> None:
        """How many waiting requests each prefilling request would hold back (dedup)."""
        self._waiters = {}
        if not prefilling:
            return
        for r in self.waiting[: self.config.scan_max]:
            leader = self._dedup_leader(r, prefilling, now)
            if leader is not None:
                self._waiters[leader.rid] = self._waiters.get(leader.rid, 0) + 1

    def _plan_ttft(self, prefilling: list[Request], now: float, budget: int,
                   free_slots: int) -> list[Chunk]:
        cfg = self.config
        self._count_waiters(prefilling, now)
        cands = sorted(prefilling + self.waiting, key=lambda r: self.priority(r, now))
        chosen: list[Request] = []
        in_flight = list(prefilling)  # requests computing uncached tokens this step
        keep = min(cfg.short_slots, cfg.max_running - 1)  # running slots long requests leave free
        for r in cands[: cfg.scan_max]:
            if r.state is RequestState.WAITING:
                is_long = self.need_of(r) > cfg.long_threshold_tokens
                if free_slots <= (keep if is_long else 0) or self._should_defer(r, in_flight, now):
                    continue
                free_slots -= 1
                in_flight.append(r)
            chosen.append(r)
        return self._split_budget(chosen, budget)

    def _should_defer(self, r: Request, in_flight: list[Request], now: float) -> bool:
        return self._dedup_leader(r, in_flight, now) is not None

    def _dedup_leader(self, r: Request, in_flight: list[Request], now: float) -> Request | None:
        """The in-flight request computing at least dedup_min_tokens of r's uncached prefix."""
        if now - r.arrival_s >= self.config.max_wait_s:
            return None
        end = r.num_tokens - r.uncached_estimate + self.config.dedup_min_tokens  # cached + min
        if end > len(r.prompt):
            return None
        head = r.prompt[:end]
        for other in in_flight:
            if other is not r and len(other.prompt) >= end and np.array_equal(other.prompt[:end], head):
                return other
        return None

    def _split_budget(self, chosen: list[Request], budget: int) -> list[Chunk]:
        cfg = self.config
        is_short = [self.need_of(r) <= cfg.long_threshold_tokens for r in chosen]
        short = int(budget * cfg.short_share) if any(is_short) else 0
        return self._grant(chosen, is_short, {True: short, False: budget - short}, srpt=cfg.srpt_chunks)

    def _grant(self, order: list[Request], bucket: list[bool], left: dict[bool, int],
               srpt: bool) -> list[Chunk]:
        """Pass 1: in order, from the request's bucket, up to chunk_tokens each (FCFS: every
        candidate moves), or with srpt up to its whole need (the head of the priority order
        finishes first instead of all sharing the step; in a queue that is what cuts TTFT).
        Pass 2 (work-conserving, both policies): leftover budget to the same order, uncapped."""
        grant = [0] * len(order)
        per_req = self.need_of if srpt else (lambda r: self.config.chunk_tokens)
        for i, r in enumerate(order):
            take = min(self.need_of(r), per_req(r), left[bucket[i]])
            grant[i] = take
            left[bucket[i]] -= take
        spare = left[True] + left[False]
        for i, r in enumerate(order):
            if spare <= 0:
                break
            more = max(0, min(self.need_of(r) - grant[i], spare))
            grant[i] += more
            spare -= more
        return [Chunk(r, g) for r, g in zip(order, grant) if g > 0]
