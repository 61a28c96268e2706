"""Which prefill chunks run in the next step. Two policies that differ ONLY in ordering.

The scheduler owns the waiting queue and its order; the running list is the Batcher's
(batcher.py: who holds pages), handed to plan() each step.

Shared by both policies (so a benchmark of one against the other measures the order alone):
  * budgeting (`_fill`): walk the order; each request takes as much of what is left of the
    step's prefill budget as it can use, up to chunk_tokens (like vLLM's
    long_prefill_token_threshold), then the next one; budget still left after everyone in
    the plan got that goes to them again in order, uncapped. With chunk_tokens >=
    max_tokens_per_step the head of the order takes the whole step, as vLLM and SGLang do
    by default. Waiting requests are admitted while running slots are free;
  * in-flight prefix dedup: a waiting request whose uncached prefix (at least
    dedup_min_tokens of it) is being computed right now by an in-flight request is held back
    and gets it as a cache hit once that prefill lands in the tree, instead of computing it
    twice; the hold ends after max_wait_s.
Orders:
  fcfs  strict arrival order (running prefills and waiting requests alike);
  ttft  shortest remaining uncached work first (uncached tokens after prefix matching): SRPT,
        which a request with a long but cached prompt (a question on a document already in
        the tree) benefits from as much as a short one. A prefill that k held-back requests
        wait for ranks by need / (1 + k) (Smith's rule: its prefill serves them all), and so
        does the oldest of k + 1 waiting requests that share an uncached prefix (a burst of
        questions on a document that is not in the tree).
        Starvation is bounded by a lane: a request that waited max_wait_s or more goes ahead
        of everyone, FCFS among the aged. aging_tokens_per_s (need - rate * wait) is off by
        default: measured with bench/worker/ttft.py, every rate tried made long-prompt P90 worse (it
        puts long-waiting heavy prefills ahead of cheap long-prompt requests).
Decodes are not planned here: the engine runs every decode first, then these chunks.
"""

from __future__ import annotations

import enum
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gcache.common.flags import flag
from gcache.worker.engine.request import Request, RequestState
from gcache.worker.integrity import require


class SchedulerPolicy(enum.StrEnum):
    """The order names SchedulerConfig.policy takes (see the module docstring)."""

    TTFT = "ttft"
    FCFS = "fcfs"


POLICIES = tuple(p.value for p in SchedulerPolicy)  # ("ttft", "fcfs")


class QueueFullError(RuntimeError):
    """The waiting queue is at max_waiting; the caller should retry later (HTTP 503)."""


class EngineStoppedError(QueueFullError):
    """The engine thread is not running (stopping, stopped or crashed): nothing is taken.
    A QueueFullError, so every handler that answers a full queue with 503 answers this too."""


@dataclass(frozen=True)
class SchedulerConfig:
    # The first five are gcache-worker flags (gcache.common.flags; the rest: tuning and benches).
    policy: str = field(  # a SchedulerPolicy (or its string)
        default=SchedulerPolicy.TTFT, metadata=flag(choices=POLICIES, from_field=str)
    )
    max_waiting: int = field(default=1024, metadata=flag())  # bound of the waiting queue
    max_running: int = field(default=32, metadata=flag())  # requests holding KV at once
    max_tokens_per_step: int = field(default=512, metadata=flag())  # decode tokens + prefill tokens per step
    chunk_tokens: int = field(  # most prefill tokens one request gets per step (both policies)
        default=256, metadata=flag()
    )
    aging_tokens_per_s: float = 0.0  # ttft: priority gained per second waited (see above)
    max_wait_s: float = 30.0  # ttft: starvation lane; both: longest dedup hold
    dedup_min_tokens: int = 32  # shared uncached prefix worth waiting for
    estimates_per_step: int = 64  # tree matches spent refreshing stale estimates per step
    scan_max: int = 256  # candidates examined per plan

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in (
            "max_waiting",
            "max_running",
            "max_tokens_per_step",
            "chunk_tokens",
            "estimates_per_step",
            "scan_max",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1")
        if self.max_running > self.max_tokens_per_step:
            raise ValueError("max_running must be <= max_tokens_per_step (every decode needs a token)")
        if self.aging_tokens_per_s < 0 or self.max_wait_s <= 0:
            raise ValueError("aging_tokens_per_s must be >= 0 and max_wait_s > 0")
        if self.dedup_min_tokens < 1:
            raise ValueError("SchedulerConfig.dedup_min_tokens must be >= 1")


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


PrefixKey = tuple[int, bytes]  # (end, digest of prompt[:end]): Scheduler._prefix_key


def arrival_key(r: Request) -> tuple[float, int]:
    return (r.arrival_s, r.rid)


class Ordering(ABC):
    """A scheduler policy: the order in which prefill candidates get the step's budget.

    The only thing the two policies differ in; budgeting and the in-flight prefix dedup are
    the Scheduler's and shared (so a benchmark of one policy against the other measures the
    order alone). Called once per step from Scheduler.plan, on the engine thread.
    """

    @abstractmethod
    def order(self, scheduler: Scheduler, prefilling: list[Request], now: float) -> list[Request]:
        """The candidates, first served first: the running requests still prefilling and
        (some of) scheduler.waiting, with estimates refreshed for this step. The caller keeps
        the first config.scan_max. May update the scheduler's per-step state (waiter counts);
        must not admit, reorder scheduler.waiting or change any request."""


class FcfsOrder(Ordering):
    """fcfs: strict arrival order, running prefills and waiting requests alike."""

    def order(self, scheduler: Scheduler, prefilling: list[Request], now: float) -> list[Request]:
        return sorted(prefilling + scheduler.waiting[: scheduler.config.scan_max], key=arrival_key)


class TtftOrder(Ordering):
    """ttft: shortest remaining uncached work first, Smith-weighted, with the starvation lane
    (Scheduler.priority)."""

    def order(self, scheduler: Scheduler, prefilling: list[Request], now: float) -> list[Request]:
        scheduler._count_waiters(prefilling, now)
        return sorted(prefilling + scheduler.waiting, key=lambda r: scheduler.priority(r, now))


ORDERINGS: dict[str, type[Ordering]] = {SchedulerPolicy.TTFT: TtftOrder, SchedulerPolicy.FCFS: FcfsOrder}


class Scheduler:
    """Owns the waiting queue (arrival order) and the order prefill candidates are served in;
    the running list (admission order) is the Batcher's."""

    def __init__(self, config: SchedulerConfig, estimate_uncached: Callable[[Request], int]) -> None:
        self.config = config
        self.ordering: Ordering = ORDERINGS[SchedulerPolicy(config.policy)]()
        self.estimate_uncached = estimate_uncached
        self.waiting: list[Request] = []
        self.epoch = 0  # bumped by the engine whenever the tree's contents change
        self._waiters: dict[int, int] = {}  # rid -> waiting requests its prefill would serve
        self._prefix_keys: dict[int, PrefixKey] = {}  # rid -> cached _prefix_key

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
        self.waiting.sort(key=arrival_key)

    def tree_changed(self) -> None:
        self.epoch += 1

    # ---- planning ----------------------------------------------------------------
    def plan(self, now: float, budget: int, running: Sequence[Request] = ()) -> list[Chunk]:
        """Prefill chunks for this step, in the order the engine should admit/run them.
        running: the requests holding pages (the Batcher's list): their prefills compete,
        and they fill running slots."""
        if budget <= 0:
            return []
        prefilling = [r for r in running if not r.is_decoding]
        self._refresh_estimates()
        order = self.ordering.order(self, prefilling, now)
        free_slots = self.config.max_running - len(running)
        return self._fill(order[: self.config.scan_max], prefilling, now, budget, free_slots)

    def _fill(
        self, order: list[Request], prefilling: list[Request], now: float, budget: int, free_slots: int
    ) -> list[Chunk]:
        """The shared budgeting. Pass 1: in order, each takes all it can use of what is left,
        up to chunk_tokens; waiting requests need a free running slot and no in-flight leader.
        Pass 2: budget still left goes to the same requests in the same order, uncapped (a
        cap below the step budget makes room for the next request; it never idles a step)."""
        in_flight = list(prefilling)  # requests computing uncached tokens
        chosen: list[Request] = []
        grants: list[int] = []
        for r in order:
            if budget <= 0:
                break
            if r.state is RequestState.WAITING:
                if free_slots <= 0:
                    continue
                self._refresh(r)  # an exact need: a stale one would leave part of the step unused
                if self._dedup_leader(r, in_flight, now) is not None:
                    continue
                free_slots -= 1
                in_flight.append(r)
            take = min(self.need_of(r), self.config.chunk_tokens, budget)
            if take > 0:
                chosen.append(r)
                grants.append(take)
                budget -= take
        for i, r in enumerate(chosen):
            if budget <= 0:
                break
            more = min(self.need_of(r) - grants[i], budget)
            grants[i] += more
            budget -= more
        return [Chunk(r, g) for r, g in zip(chosen, grants)]

    def _refresh_estimates(self) -> None:
        """Bounded work per step: the ordering may use estimates a few steps old."""
        stale = [r for r in self.waiting if r.estimate_epoch != self.epoch]
        stale.sort(key=lambda r: r.estimate_epoch)  # oldest estimates first
        for r in stale[: self.config.estimates_per_step]:
            self._refresh(r)

    def _refresh(self, r: Request) -> None:
        if r.estimate_epoch != self.epoch:
            r.uncached_estimate = self.estimate_uncached(r)
            r.estimate_epoch = self.epoch

    def need_of(self, r: Request) -> int:
        return r.to_compute if r.state is RequestState.RUNNING else r.uncached_estimate

    def priority(self, r: Request, now: float) -> tuple[float, ...]:
        """TTFT order, smaller first. need / (1 + waiters) is Smith's rule: a prefill that k
        held-back requests will reuse finishes k + 1 first tokens' worth of work, so it ranks
        as if it were k + 1 times shorter (otherwise a hot document's first reader, being
        long, ranks last and its followers wait behind everyone)."""
        wait = now - r.arrival_s
        if wait >= self.config.max_wait_s:
            return (0, r.arrival_s, r.rid)  # starvation lane: FCFS among the aged
        need = self.need_of(r) / (1 + self._waiters.get(r.rid, 0))
        return (1, need - self.config.aging_tokens_per_s * wait, r.arrival_s, r.rid)

    # ---- prefix dedup (both policies) and grouping (ttft's Smith weights) --------------------
    def _count_waiters(self, prefilling: list[Request], now: float) -> None:
        """Smith's-rule weights: how many waiting requests each request's prefill would serve.
        A prefilling request counts the waiting requests held back for it (dedup); waiting
        requests that share an uncached prefix form a group, and its oldest member counts the
        rest (it is admitted first, and the dedup then holds the others back for it).
        Without the groups, a burst of questions on an evicted document all rank as long
        requests and wait behind everything until one of them happens to start."""
        self._waiters = {}
        groups: dict[PrefixKey, Request] = {}  # prefix key -> oldest waiting member
        keys: dict[int, PrefixKey] = {}
        for r in self.waiting[: self.config.scan_max]:  # arrival order: the first seen is the oldest
            if now - r.arrival_s >= self.config.max_wait_s:
                continue  # not held back any more: it computes its own prefix
            leader = self._dedup_leader(r, prefilling, now) if prefilling else None
            if leader is None:
                key = self._prefix_key(r)
                if key is None:
                    continue
                keys[r.rid] = key
                leader = groups.setdefault(key, r)
                if leader is r:
                    continue
            self._waiters[leader.rid] = self._waiters.get(leader.rid, 0) + 1
        self._prefix_keys = keys  # only the current waiting requests' keys stay cached

    def _prefix_key(self, r: Request) -> PrefixKey | None:
        """(end, digest of r's prompt[:end]) with end = dedup_min_tokens past r's cached part:
        two requests with equal keys share at least dedup_min_tokens of uncached prefix.
        Cached per request while end stays (hashing a long prompt every step would cost)."""
        end = r.num_tokens - r.uncached_estimate + self.config.dedup_min_tokens
        if end > len(r.prompt):
            return None
        old = self._prefix_keys.get(r.rid)
        if old is not None and old[0] == end:
            return old
        # numpy's stubs give ndarray the buffer protocol only for Python >= 3.12
        return (end, hashlib.blake2b(r.prompt[:end], digest_size=16).digest())  # type: ignore[arg-type]

    def _dedup_leader(self, r: Request, in_flight: list[Request], now: float) -> Request | None:
        """The in-flight request computing at least dedup_min_tokens of r's uncached prefix."""
        if now - r.arrival_s >= self.config.max_wait_s:
            return None
        end = r.num_tokens - r.uncached_estimate + self.config.dedup_min_tokens  # cached + min
        if end > len(r.prompt):
            return None
        head, last = r.prompt[:end], r.prompt[end - 1]
        for other in in_flight:  # the last-token test first: most pairs differ there, cheaply
            if (
                other is not r
                and len(other.prompt) >= end
                and other.prompt[end - 1] == last
                and np.array_equal(other.prompt[:end], head)
            ):
                return other
        return None
