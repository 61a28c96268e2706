"""Continuous batching over the dual KV pools, with the prefix cache behind a CacheManager.

One step, top to bottom:
  receive   cache.poll(waiting): L3 prefetches start for queued requests;
  schedule  every decoding request gets one token, then the scheduler's prefill chunks
            (waiting requests are admitted on the way when the prefetch policy says they
            are ready and the pools have room) fill the rest of the token budget;
  load      admission runs cache.prepare_load (lock the L1 match, queue the L2/L3 part's
            copies); cache.start_loads() starts them layer by layer;
  forward   one model.forward_batch for the whole batch; layer i waits for its loads;
  write     after prefill, and every ~W decoded tokens, cache.prepare_write hands the
            computed pages to the cache (and the tiers below, per the write policy);
            cache.trim_swa frees SWA pages that left the window and no checkpoint needs;
  finish    cache.prepare_write(final) + cache.release, and the request is done.
Pages short: cache.evict, then trim running requests' SWA under pressure, then preempt the
most recently admitted request. The engine is single-threaded: only its owner thread calls
add_request/step (the cache's L3 threads never touch the device pools).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.common.flags import flag
from gcache.worker import backend
from gcache.worker.config import MTP_LAYERS_MAX
from gcache.worker.engine.metrics import EngineMetrics
from gcache.worker.engine.request import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    FinishReason,
    Request,
    RequestState,
    SamplingParams,
)
from gcache.worker.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from gcache.worker.engine.speculative import Speculator
from gcache.worker.integrity import require
from gcache.worker.kvcache.cache_manager import CacheManager
from gcache.worker.kvcache.hicache import HiCache
from gcache.worker.kvcache.hicache_config import HiCacheConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.prefix_cache_off import NoPrefixCache

if TYPE_CHECKING:  # the model room sits beside the engine's, not below it
    from gcache.worker.kvcache.swa_radix_tree import SWARadixTree
    from gcache.worker.model.base import BatchModel

__all__ = ["Engine", "EngineConfig", "QueueFullError"]


@dataclass(frozen=True)
class EngineConfig:
    # Flags of gcache-worker are marked (gcache.common.flags).
    max_prompt_tokens: int = field(default=8192, metadata=flag())
    max_new_tokens: int = field(default=2048, metadata=flag())
    prefix_cache: bool = field(
        default=True,
        metadata=flag(name="--no-prefix-cache", dest="no_prefix_cache", action="store_true", to_field=operator.not_),
    )
    preemptions_per_step_max: int = 8
    tree_nodes_max: int = 1_000_000
    mtp_layers: int = field(  # speculative decoding with this many MTP drafts per step (0 = off)
        default=0,
        metadata=flag(
            "speculative decoding: K MTP drafts per step, verified in one forward (0 = off; "
            "the weights need >= K MTP blocks, or seeded ones are made)",
            choices=range(0, MTP_LAYERS_MAX + 1),
            metavar="K",
        ),
    )
    mtp_prefix: str = "tiers"  # a speculative.MTPPrefix: where a request's MTP KV comes from
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "preemptions_per_step_max", "tree_nodes_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1")
        if not 0 <= self.mtp_layers <= MTP_LAYERS_MAX:
            raise ValueError(f"EngineConfig.mtp_layers must be in [0, {MTP_LAYERS_MAX}]")


class Engine:
    def __init__(
        self,
        model: BatchModel,
        kv: DualKVCache,
        config: EngineConfig = EngineConfig(),
        clock: Callable[[], float] = time.monotonic,
        cache: CacheManager | None = None,
    ) -> None:
        self.model, self.kv, self.config, self.clock = model, kv, config, clock
        self.page_size, self.window = kv.page_size, kv.window
        self.vocab_size = kv.config.vocab_size
        chunk = config.scheduler.chunk_tokens
        swa_min = -(-(self.window + chunk) // self.page_size) + 4  # + margin, partial pages
        if kv.swa.num_pages < swa_min:
            raise ValueError(
                f"SWA pool has {kv.swa.num_pages} pages; a window of {self.window} plus a "
                f"{chunk}-token chunk needs at least {swa_min}"
            )
        if cache is None:
            cache = (
                HiCache(kv, config.hicache, nodes_max=config.tree_nodes_max)
                if config.prefix_cache
                else NoPrefixCache(kv)
            )
        self.cache = cache
        self.spec = Speculator(model, config.mtp_layers, config.mtp_prefix) if config.mtp_layers else None
        self.scheduler = Scheduler(config.scheduler, self.cache.estimate_uncached)
        self.metrics = EngineMetrics()
        self.last_step_ran = False
        self._preemptions_left = 0
        self._update_gauges()

    @property
    def tree(self) -> SWARadixTree | None:
        """The L1 prefix tree (None without a prefix cache)."""
        return getattr(self.cache, "tree", None)

    # ---- submission -------------------------------------------------------------
    def add_request(
        self,
        prompt: Sequence[int] | np.ndarray,
        params: SamplingParams,
        record_logits: bool = False,
        handed: Sequence[int] = (),
    ) -> Request:
        """Validate and enqueue; ValueError for bad input, QueueFullError when full.
        `handed`: output tokens another worker already sampled (a PD handoff): the request
        continues after them, as if it had sampled them itself (same RNG draws)."""
        try:
            prompt = self._validate(prompt, params)
            req = Request(prompt, params, self.clock(), record_logits, page_size=self.page_size)
            if handed:
                if len(handed) >= params.max_tokens or not all(0 <= int(t) < self.vocab_size for t in handed):
                    raise ValueError("handed tokens must be fewer than max_tokens and inside the vocabulary")
                req.output = [int(t) for t in handed]
                req.first_token_s = req.arrival_s  # its first token was another worker's (no TTFT here)
                for _ in handed if float(params.temperature) else ():
                    req.rng.random()  # one draw per sampled token, as _sample does
            self.scheduler.submit(req)
        except (ValueError, QueueFullError):
            self.metrics.inc("requests_rejected_total")
            raise
        return req

    def _validate(self, prompt: Sequence[int] | np.ndarray, params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be SamplingParams")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError("prompt must be a non-empty list of token ids")
        if ids.size > self.config.max_prompt_tokens:
            raise ValueError(f"prompt has {ids.size} tokens; the limit is {self.config.max_prompt_tokens}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if params.max_tokens > self.config.max_new_tokens:
            raise ValueError(f"max_tokens {params.max_tokens} exceeds the limit {self.config.max_new_tokens}")
        pages = -(-(ids.size + params.max_tokens) // self.page_size)
        if pages > self.kv.full.num_pages:
            raise ValueError(f"prompt + max_tokens needs {pages} KV pages; the pool has {self.kv.full.num_pages}")
        return [int(t) for t in ids]

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- one step ------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it."""
        self.cache.poll(self.scheduler.waiting)  # receive
        batch = self._schedule()  # schedule (+ admission)
        finished: list[Request] = []
        self.last_step_ran = bool(batch)
        if batch:
            loads = self.cache.start_loads()  # load, layer by layer
            try:
                if self.spec is None:
                    work = [(r.token_slice(r.num_computed, r.num_computed + n), None, r.held_kv) for r, n in batch]
                    logits = self.model.forward_batch(work, self.kv, layer_ready=loads.wait_layer)  # forward
                else:  # MTP: drafts ride along (verify), hidden states feed the MTP blocks
                    work = [(self.spec.chunk(r, n), None, r.held_kv) for r, n in batch]
                    logits = self.spec.forward(work, self.kv, loads.wait_layer)
            finally:
                loads.finish()
            self.metrics.inc("steps_total")
            for (r, n), lg in zip(batch, logits):
                if self.spec is None:
                    self._after_forward(r, n, lg, finished)  # write, finish
                else:
                    self.spec.after_forward(self, r, n, lg, finished)
        self._update_gauges()
        return finished

    def _schedule(self) -> list[tuple[Request, int]]:
        sched = self.scheduler
        self._preemptions_left = self.config.preemptions_per_step_max
        batch: list[tuple[Request, int]] = []
        decodes = [r for r in sched.running if r.is_decoding]
        budget = sched.config.max_tokens_per_step
        for r in decodes:
            n = 1 if self.spec is None else self.spec.decode_tokens(r)
            if n > 1 and r.state is RequestState.RUNNING and not self._reserve(r, n, may_preempt=False):
                r.draft, r.draft_rows, n = [], [], 1  # no room for the drafts: decode plainly
            if r.state is RequestState.RUNNING and self._reserve(r, n, may_preempt=True):
                batch.append((r, n))
            budget -= n
        budget = max(0, budget)
        admitting = True
        for chunk in sched.plan(self.clock(), budget):
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
                    self._release(r, preempted=False)  # pools full: no new admissions this step
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
        for r in [r for r in sched.running if not r.is_decoding and id(r) not in in_batch]:
            n = min(budget, r.to_compute)
            if n > 0 and r.state is RequestState.RUNNING and self._reserve(r, n, may_preempt=False):
                batch.append((r, n))
                budget -= n
        return [(r, n) for r, n in batch if r.state is RequestState.RUNNING]

    def run_until_idle(self, steps_max: int = 100_000, on_step: Callable[[], None] | None = None) -> None:
        for _ in range(steps_max):
            if not self.has_work():
                return
            self.step()
            if not self.last_step_ran:
                time.sleep(0.001)  # every waiting request waits on its L3 prefetch
            if on_step is not None:
                on_step()
        raise RuntimeError(f"engine still busy after {steps_max} steps")

    def _after_forward(self, r: Request, n: int, logits: Any, finished: list[Request]) -> None:
        if not r.output or n > 1:
            self.metrics.inc("prefill_tokens_computed_total", n)
        self.cache.trim_swa(r)
        if r.num_computed < r.num_tokens:
            return  # mid-prefill: nothing to sample yet
        row = backend.to_numpy(logits)[-1]
        if r.logits is not None:
            r.logits.append(np.array(row, dtype=np.float64))
        if (
            not r.prefix_cached
            or r.num_computed - r.held_kv.owned_from * self.page_size >= self.window + 2 * self.page_size
        ):
            # After prefill, then every ~W decoded tokens: re-locking at the current end keeps
            # the SWA the lock pins equal to the window r needs anyway (SGLang releases it).
            r.prefix_cached = True
            self.cache.prepare_write(r, final=False)
            self.scheduler.tree_changed()
        tok = self._sample(row, r)
        r.output.append(tok)
        self.metrics.inc("generation_tokens_total")
        if r.first_token_s is None:
            r.first_token_s = self.clock()
            self.metrics.observe_ttft(r.first_token_s - r.arrival_s)
        if tok in r.params.stop_token_ids:
            self._finish(r, FINISH_STOP, finished)
        elif len(r.output) >= r.params.max_tokens:
            self._finish(r, FINISH_LENGTH, finished)

    @staticmethod
    def _sample(row: np.ndarray, r: Request) -> int:
        t = float(r.params.temperature)
        if t == 0.0:
            return int(np.argmax(row))
        z = row.astype(np.float64) / t
        p = np.exp(z - z.max())
        cdf = np.cumsum(p)
        return int(min(np.searchsorted(cdf, r.rng.random() * cdf[-1], side="right"), row.size - 1))

    # ---- admission, pages, preemption ------------------------------------------------
    def _has_room_for(self, r: Request) -> bool:
        """Admit only if the pools (after evicting cold cache) can hold r's whole remaining
        prefill plus one page of decode headroom per running request; admitting on less
        just leads to preemption churn. Pages loaded from L2/L3 need device pages too, so
        only the L1 part of the match counts as room already held."""
        ps = self.page_size
        not_on_device = r.num_tokens - self.cache.match(r).l1_len
        need_full = -(-(not_on_device + 1) // ps) + len(self.scheduler.running) + 1
        swa_cap = -(-(self.window + self.scheduler.config.chunk_tokens) // ps) + 2
        need_swa = min(need_full, swa_cap + len(self.scheduler.running))
        short_full = max(0, need_full - self.kv.full.num_free)
        short_swa = max(0, need_swa - self.kv.swa.num_free)
        if short_full or short_swa:
            if self.cache.evict(short_full, short_swa) != (0, 0):
                self.scheduler.tree_changed()
            short_full = max(0, need_full - self.kv.full.num_free)
            short_swa = max(0, need_swa - self.kv.swa.num_free)
        return not short_full and not short_swa or not self.scheduler.running

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
        self.scheduler.running.append(r)

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
        for _ in range(2 * len(self.scheduler.running) + 4):
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
            victim = self.scheduler.running[-1]
            self._release(victim, preempted=True)
            if victim is r:
                return False
        return False

    def _free_running_swa(self) -> int:
        """Last resort before preempting: drop every running request's own out-of-window SWA,
        checkpoint tails included (those prefixes are then cached only up to an earlier
        checkpoint, but nobody needs them to continue)."""
        return sum(self.cache.trim_swa(r, pressure=True) for r in self.scheduler.running)

    def _release(self, r: Request, preempted: bool) -> None:
        """Give back r's own pages and its lock; r goes back to the waiting queue."""
        if self.spec is not None:
            self.spec.drop(r)
        self.cache.release(r)
        r.prefix_cached = False
        r.state = RequestState.WAITING
        self.scheduler.running.remove(r)
        self.scheduler.requeue(r)
        if preempted:
            r.preemptions += 1
            self._preemptions_left -= 1
            self.metrics.inc("preemptions_total")

    def _finish(self, r: Request, reason: FinishReason, finished: list[Request]) -> None:
        if r.num_computed // self.page_size > r.held_kv.owned_from:
            self.scheduler.tree_changed()
        self.cache.prepare_write(r, final=True)
        if self.spec is not None:
            self.spec.drop(r)
        self.cache.release(r)
        r.state, r.finish_reason, r.finished_s = RequestState.FINISHED, reason, self.clock()
        self.scheduler.running.remove(r)
        self.metrics.inc("requests_total")
        self.metrics.inc("prompt_tokens_total", len(r.prompt))
        finished.append(r)

    def abort_all(self, reason: str = "engine stopped") -> list[Request]:
        """Finish every request with finish_reason 'abort' (shutdown)."""
        out: list[Request] = []
        for r in list(self.scheduler.running):
            self._release(r, preempted=False)
        for r in list(self.scheduler.waiting):
            self.cache.drop_waiting(r)
            r.state, r.finish_reason, r.error, r.finished_s = RequestState.FINISHED, FINISH_ABORT, reason, self.clock()
            out.append(r)
        self.scheduler.waiting.clear()
        self._update_gauges()
        return out

    def finish_early(self, r: Request, reason: FinishReason = FINISH_STOP) -> bool:
        """Finish r now: a stop string matched (reason 'stop') or its client went away ('abort').
        A decoding request finishing with 'stop' ends as if it had sampled a stop token (its
        KV goes to the cache); any other running request gives its pages back; a waiting one
        leaves the queue. Only the engine's owner thread calls this, between steps.
        Returns False if r had already finished."""
        if r.state is RequestState.FINISHED:
            return False
        if r.state is RequestState.RUNNING and reason == FINISH_STOP and r.is_decoding:
            self._finish(r, reason, [])
        else:
            if r.state is RequestState.RUNNING:
                self._release(r, preempted=False)  # back to waiting, then dropped below
            self.cache.drop_waiting(r)
            self.scheduler.waiting.remove(r)
            r.state, r.finish_reason, r.finished_s = RequestState.FINISHED, reason, self.clock()
            self.metrics.inc("requests_total")
            self.metrics.inc("prompt_tokens_total", len(r.prompt))
        self._update_gauges()
        return True

    def close(self) -> None:
        """Stop the cache's background threads (L3 writers and prefetchers)."""
        self.cache.close()

    # ---- integrity and gauges ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pools, every cache tier, and the engine's own rule: every used page has exactly
        one owner. Raises IntegrityError (also under python -O)."""
        self.kv.check_integrity()
        running = self.scheduler.running
        for r in running:
            kv = r.kv
            require(r.state is RequestState.RUNNING and kv is not None, f"{r} runs without pages")
            if kv is None:  # cannot happen: for the type checker: require raised otherwise
                raise RuntimeError("invariant broken: for the type checker: require raised otherwise")
            require(
                kv.num_pages >= kv.pages_for(kv.num_tokens) and len(kv.swa_pages) == kv.num_pages,
                f"{r}: page tables do not cover its tokens",
            )
            for p in kv.full_pages:
                require(self.kv.full.is_allocated(p), f"{r} references free full page {p}")
            start = max(0, (kv.num_tokens - self.window) // self.page_size)
            for sp in kv.swa_pages[start:]:
                require(sp is not None and self.kv.swa.is_allocated(sp), f"{r} lost SWA of its window")
        for r in self.scheduler.waiting:
            require(
                r.state is RequestState.WAITING and r.kv is None and r.lock_node is None,
                f"{r} waits while holding pages",
            )
        self.cache.check_integrity(running, self.scheduler.waiting)

    def _update_gauges(self) -> None:
        tf, ts = self.cache.cached_pages()
        self.metrics.set_gauges(
            waiting_requests=len(self.scheduler.waiting),
            running_requests=len(self.scheduler.running),
            full_pool_pages_used=self.kv.full.num_used,
            full_pool_pages_total=self.kv.full.num_pages,
            swa_pool_pages_used=self.kv.swa.num_used,
            swa_pool_pages_total=self.kv.swa.num_pages,
            tree_full_pages=tf,
            tree_swa_pages=ts,
        )
        self.metrics.set_cache_stats(self.cache.stats())
