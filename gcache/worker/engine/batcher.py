"""Which requests run in the next step and with which pages: admission, page reservation,
preemption, release and finish, around the Scheduler (which only orders prefill chunks).

schedule(): every decoding request gets its positions first (one token, or its last token
and its drafts: DecodingStrategy.decode_tokens; drafts are dropped before anyone is
preempted for them), then the scheduler's prefill chunks fill the rest of the token
budget; waiting requests are admitted on the way when the prefetch policy says they are
ready and the pools have room (cache.prepare_load locks the L1 match and queues the
L2/L3 copies). Pages short: cache.evict, then trim running requests' SWA under pressure,
then preempt the most recently admitted request (at most preemptions_per_step_max a step).
release() gives a request's pages and lock back (it waits again); finish() hands its KV to
the cache first (cache.prepare_write(final)). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gcache.worker.engine.decoding import DecodingStrategy
from gcache.worker.engine.metrics import EngineMetrics
from gcache.worker.engine.request import FINISH_ABORT, FINISH_STOP, FinishReason, Request, RequestState
from gcache.worker.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from gcache.worker.kvcache.cache_manager import CacheManager
    from gcache.worker.kvcache.kv_pool import DualKVCache


class Batcher:
    """Owns who holds pages: the running list (admission order), its admissions,
    reservations and departures. The scheduler owns only the waiting queue's order."""

    def __init__(
        self,
        scheduler: Scheduler,
        cache: CacheManager,
        kv: DualKVCache,
        decoding: DecodingStrategy,
        metrics: EngineMetrics,
        clock: Callable[[], float],
        preemptions_per_step_max: int,
    ) -> None:
        self.scheduler, self.cache, self.kv, self.decoding = scheduler, cache, kv, decoding
        self.metrics, self.clock = metrics, clock
        self.page_size, self.window = kv.page_size, kv.window
        self.preemptions_per_step_max = preemptions_per_step_max
        self._preemptions_left = 0
        self.running: list[Request] = []

    # ---- the next batch ------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        """(request, positions) of the next step, every one's pages reserved."""
        sched = self.scheduler
        self._preemptions_left = self.preemptions_per_step_max
        batch: list[tuple[Request, int]] = []
        decodes = [r for r in self.running if r.is_decoding]
        budget = sched.config.max_tokens_per_step
        for r in decodes:
            n = self.decoding.decode_tokens(r)
            if n > 1 and r.state is RequestState.RUNNING and not self._reserve(r, n, may_preempt=False):
                self.decoding.drop_drafts(r)  # no room for the drafts: decode plainly
                n = 1
            if r.state is RequestState.RUNNING and self._reserve(r, n, may_preempt=True):
                batch.append((r, n))
            budget -= n
        budget = max(0, budget)
        admitting = True
        for chunk in sched.plan(self.clock(), budget, self.running):
            r = chunk.req
            if r.state is RequestState.WAITING:
                if not admitting or not self.cache.ready(r):
                    continue  # not ready: its L3 prefetch is still running (prefetch policy)
                if not self._has_room_for(r):
                    admitting = False  # admit in order: nobody jumps a request that does not fit
                    continue
                self._admit(r)
                n = self._reserve_prefill(r, min(chunk.tokens, r.to_compute), may_preempt=False)
                if not n:
                    self.release(r, preempted=False)  # pools full: no new admissions this step
                    admitting = False
                    continue
            elif r.state is not RequestState.RUNNING:
                continue
            else:
                n = self._reserve_prefill(r, min(chunk.tokens, r.to_compute), may_preempt=True)
                if not n:
                    continue
            batch.append((r, n))
            budget -= n
        # Budget planned for a waiting request that could not be admitted goes to running
        # prefills the plan left out: otherwise one holding the pages that request waits
        # for gets nothing either, and no step runs until max_wait_s reorders the plan.
        in_batch = {id(r) for r, _ in batch}
        for r in [r for r in self.running if not r.is_decoding and id(r) not in in_batch]:
            n = min(budget, r.to_compute)
            if n > 0 and r.state is RequestState.RUNNING and self._reserve(r, n, may_preempt=False):
                batch.append((r, n))
                budget -= n
        return [(r, n) for r, n in batch if r.state is RequestState.RUNNING]

    # ---- admission, pages, preemption ------------------------------------------------
    def _has_room_for(self, r: Request) -> bool:
        """Admit only if the pools (after evicting cold cache) can hold r's whole remaining
        prefill plus one page of decode headroom per running request; admitting on less
        just leads to preemption churn. Pages loaded from L2/L3 need device pages too, so
        only the L1 part of the match counts as room already held."""
        ps = self.page_size
        not_on_device = r.num_tokens - self.cache.match(r).l1_len
        need_full = -(-(not_on_device + 1) // ps) + len(self.running) + 1
        swa_cap = -(-(self.window + self.scheduler.config.chunk_tokens) // ps) + 2
        need_swa = min(need_full, swa_cap + len(self.running))
        short_full = max(0, need_full - self.kv.full.num_free)
        short_swa = max(0, need_swa - self.kv.swa.num_free)
        if short_full or short_swa:
            if self.cache.evict(short_full, short_swa) != (0, 0):
                self.scheduler.tree_changed()
            short_full = max(0, need_full - self.kv.full.num_free)
            short_swa = max(0, need_swa - self.kv.swa.num_free)
        return not short_full and not short_swa or not self.running

    def _admit(self, r: Request) -> None:
        m = self.cache.prepare_load(r)
        if r.admitted_s is None:
            r.admitted_s = self.clock()
            r.cached_tokens = min(r.num_computed, len(r.prompt))
            r.cached_by_tier = dict(m.by_tier)
            self.metrics.inc("cached_prompt_tokens_total", r.cached_tokens)
            for tier, n in m.by_tier.items():
                self.metrics.inc(f"cached_tokens_{tier}_total", n)
        r.prefix_cached = False
        r.state = RequestState.RUNNING
        self.scheduler.waiting.remove(r)
        self.running.append(r)

    def _reserve_prefill(self, r: Request, n: int, may_preempt: bool) -> int:
        """Pages for a prefill chunk of up to n tokens; returns the tokens reserved (0: none).
        Beyond chunk_tokens (the plan's uncapped second pass) the chunk takes only what the
        pools have: admission sized the SWA pool for chunk_tokens, and preempting r for more
        would throw its progress away, step after step (a livelock on a small SWA pool)."""
        cap = self.scheduler.config.chunk_tokens
        if n > cap:
            if self._reserve(r, n, may_preempt=False):
                return n
            n = cap
        return n if self._reserve(r, n, may_preempt) else 0

    def _reserve(self, r: Request, n: int, may_preempt: bool) -> bool:
        """Pages for r's next n tokens. False if it cannot have them now (r may be preempted)."""
        target = r.num_computed + n
        for _ in range(2 * len(self.running) + 4):
            kv = r.held_kv
            if kv.grow(self.kv, target):
                return True
            need = kv.pages_for(target) - kv.num_pages
            short_full = max(0, need - self.kv.full.num_free)
            short_swa = max(0, need - self.kv.swa.num_free)
            if self.cache.evict(short_full, short_swa) != (0, 0):
                self.scheduler.tree_changed()
                continue
            if short_swa and not short_full and self._free_running_swa():
                continue
            if not may_preempt or self._preemptions_left <= 0:
                return False
            victim = self.running[-1]
            self.release(victim, preempted=True)
            if victim is r:
                return False
        return False

    def _free_running_swa(self) -> int:
        """Last resort before preempting: drop every running request's own out-of-window SWA,
        checkpoint tails included (those prefixes are then cached only up to an earlier
        checkpoint, but nobody needs them to continue)."""
        return sum(self.cache.trim_swa(r, pressure=True) for r in self.running)

    # ---- departures ------------------------------------------------------------------------
    def release(self, r: Request, preempted: bool) -> None:
        """Give back r's own pages and its lock; r goes back to the waiting queue."""
        self.decoding.forget(r)
        self.cache.release(r)
        r.prefix_cached = False
        r.state = RequestState.WAITING
        self.running.remove(r)
        self.scheduler.requeue(r)
        if preempted:
            r.preemptions += 1
            self._preemptions_left -= 1
            self.metrics.inc("preemptions_total")

    def finish(self, r: Request, reason: FinishReason) -> None:
        """r is done: its KV goes to the cache, its pages and lock back; it leaves running."""
        if r.num_computed // self.page_size > r.held_kv.owned_from:
            self.scheduler.tree_changed()
        self.cache.prepare_write(r, final=True)
        self.decoding.forget(r)
        self.cache.release(r)
        r.state, r.finish_reason, r.finished_s = RequestState.FINISHED, reason, self.clock()
        self.running.remove(r)
        self.metrics.inc("requests_total")
        self.metrics.inc("prompt_tokens_total", len(r.prompt))

    def drop(self, r: Request, reason: FinishReason) -> None:
        """Finish r without keeping its KV: a running one gives its pages back, a waiting
        one leaves the queue (its prefetch dropped)."""
        if r.state is RequestState.RUNNING:
            self.release(r, preempted=False)  # back to waiting, then dropped below
        self.cache.drop_waiting(r)
        self.scheduler.waiting.remove(r)
        r.state, r.finish_reason, r.finished_s = RequestState.FINISHED, reason, self.clock()

    def finish_early(self, r: Request, reason: FinishReason) -> bool:
        """Engine.finish_early; False if r had already finished."""
        if r.state is RequestState.FINISHED:
            return False
        if r.state is RequestState.RUNNING and reason == FINISH_STOP and r.is_decoding:
            self.finish(r, reason)
        else:
            self.drop(r, reason)
            self.metrics.inc("requests_total")
            self.metrics.inc("prompt_tokens_total", len(r.prompt))
        return True

    def abort_all(self, reason: str) -> list[Request]:
        """Every request leaves with finish_reason 'abort' (shutdown); returns the waiting
        ones (the running ones go back to waiting first, and so are among them)."""
        out: list[Request] = []
        for r in list(self.running):
            self.release(r, preempted=False)
        for r in list(self.scheduler.waiting):
            self.cache.drop_waiting(r)
            r.state, r.finish_reason, r.error, r.finished_s = RequestState.FINISHED, FINISH_ABORT, reason, self.clock()
            out.append(r)
        self.scheduler.waiting.clear()
        return out
