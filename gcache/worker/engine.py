"""Continuous batching over the dual KV pools and the SWA prefix tree.

One step: every decoding request gets one token, then the scheduler's prefill chunks
(waiting requests are admitted on the way) fill the rest of the token budget; all of it
runs as one `forward_batch`. Page life cycle of a request:
  admit    tree.match(tokens[:-1]) -> lock -> borrow the matched full pages and the
           window-tail SWA pages (pages [0, owned_from) of its RequestKV);
  prefill  allocate pages chunk by chunk (short pools: tree.evict, then free out-of-window
           SWA of running requests, then preempt the most recently admitted request);
  prefill done  hand the computed prompt pages to the tree and re-lock at the new node, so
           other requests can hit the prompt while this one decodes;
  decode   SWA pages wholly out of the window (one page of margin, so the finished branch
           stays window-safe) go back to the pool;
  finish   insert all computed pages (the tree takes ownership), free the partial last
           page, unlock.
The engine is single-threaded: only its owner thread calls add_request/step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import backend
from .kv_pool import DualKVCache, RequestKV
from .metrics import EngineMetrics
from .request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, RequestState, SamplingParams
from .scheduler import QueueFullError, Scheduler, SchedulerConfig

__all__ = ["Engine", "EngineConfig", "QueueFullError"]


@dataclass(frozen=True)
class EngineConfig:
    max_prompt_tokens: int = 8192
    max_new_tokens: int = 2048
    prefix_cache: bool = True
    preemptions_per_step_max: int = 8
    tree_nodes_max: int = 1_000_000
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "preemptions_per_step_max", "tree_nodes_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1")


class Engine:
    def __init__(self, model, kv: DualKVCache, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.kv, self.config, self.clock = model, kv, config, clock
        self.page_size, self.window = kv.page_size, kv.window
        self.vocab_size = kv.config.vocab_size
        chunk = config.scheduler.chunk_tokens
        swa_min = -(-(self.window + chunk) // self.page_size) + 4  # + margin, partial pages
        if kv.swa.num_pages < swa_min:
            raise ValueError(f"SWA pool has {kv.swa.num_pages} pages; a window of {self.window} plus a "
                             f"{chunk}-token chunk needs at least {swa_min}")
        self.tree = None
        if config.prefix_cache:
            from .swa_radix_tree import SWARadixTree
            self.tree = SWARadixTree(self.page_size, self.window, kv.full, kv.swa,
                                     nodes_max=config.tree_nodes_max)
        self.scheduler = Scheduler(config.scheduler, self._estimate_uncached)
        self.metrics = EngineMetrics()
        self._preemptions_left = 0
        self._update_gauges()

    # ---- submission -------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams, record_logits: bool = False) -> Request:
        """Validate and enqueue; ValueError for bad input, QueueFullError when full."""
        try:
            prompt = self._validate(prompt, params)
            req = Request(prompt, params, self.clock(), record_logits)
            self.scheduler.submit(req)
        except (ValueError, QueueFullError):
            self.metrics.inc("requests_rejected_total")
            raise
        return req

    def _validate(self, prompt, params: SamplingParams) -> list[int]:
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
        sched = self.scheduler
        self._preemptions_left = self.config.preemptions_per_step_max
        batch: list[tuple[Request, int]] = []
        decodes = [r for r in sched.running if r.is_decoding]
        for r in decodes:
            if r.state is RequestState.RUNNING and self._reserve(r, 1, may_preempt=True):
                batch.append((r, 1))
        budget = sched.config.max_tokens_per_step - len(decodes)
        admitting = True
        for chunk in sched.plan(self.clock(), budget):
            r = chunk.req
            if r.state is RequestState.WAITING:
                if not admitting:
                    continue
                if not self._has_room_for(r):
                    admitting = False  # admit in order: nobody jumps a request that does not fit
                    continue
                self._admit(r)
                if not self._reserve(r, min(chunk.tokens, r.to_compute), may_preempt=False):
                    self._release(r, preempted=False)  # pools full: no new admissions this step
                    admitting = False
                    continue
            elif r.state is not RequestState.RUNNING or not self._reserve(
                    r, min(chunk.tokens, r.to_compute), may_preempt=True):
                continue
            batch.append((r, min(chunk.tokens, r.to_compute)))
        batch = [(r, n) for r, n in batch if r.state is RequestState.RUNNING]
        finished: list[Request] = []
        if batch:
            work = [(r.token_slice(r.num_computed, r.num_computed + n), None, r.kv) for r, n in batch]
            logits = self.model.forward_batch(work, self.kv)
            self.metrics.inc("steps_total")
            for (r, n), lg in zip(batch, logits):
                self._after_forward(r, n, lg, finished)
        self._update_gauges()
        return finished

    def run_until_idle(self, steps_max: int = 100_000, on_step: Callable[[], None] | None = None) -> None:
        for _ in range(steps_max):
            if not self.has_work():
                return
            self.step()
            if on_step is not None:
                on_step()
        raise RuntimeError(f"engine still busy after {steps_max} steps")

    def _after_forward(self, r: Request, n: int, logits, finished: list[Request]) -> None:
        if not r.output or n > 1:
            self.metrics.inc("prefill_tokens_computed_total", n)
        if self.tree is None:  # nothing to cache: SWA is O(W) from the first chunk on
            r.kv.free_swa_out_of_window(self.kv)
        if r.num_computed < r.num_tokens:
            return  # mid-prefill: nothing to sample yet
        row = backend.to_numpy(logits)[-1]
        if r.logits is not None:
            r.logits.append(np.array(row, dtype=np.float64))
        if self.tree is not None and (not r.prefix_cached or r.num_computed - r.kv.owned_from
                                      * self.page_size >= self.window + 2 * self.page_size):
            self._cache_prefix(r)  # after prefill, then every ~W decoded tokens (see _cache_prefix)
        tok = self._sample(row, r)
        r.output.append(tok)
        self.metrics.inc("generation_tokens_total")
        if r.first_token_s is None:
            r.first_token_s = self.clock()
            self.metrics.observe_ttft(r.ttft_s)
        if tok in r.params.stop_token_ids:
            self._finish(r, FINISH_STOP, finished)
        elif len(r.output) >= r.params.max_tokens:
            self._finish(r, FINISH_LENGTH, finished)
        elif self.tree is not None:  # one page of margin keeps the finished tail window-safe
            r.kv.free_swa_out_of_window(self.kv, r.num_computed - self.page_size)

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
    def _estimate_uncached(self, r: Request) -> int:
        if self.tree is None:
            return r.num_tokens
        return r.num_tokens - self.tree.match(r.tokens()).prefix_len  # leaves >= 1 token

    def _has_room_for(self, r: Request) -> bool:
        """Admit only if the pools (after evicting cold cache) can hold r's whole remaining
        prefill plus one page of decode headroom per running request; admitting on less
        just leads to preemption churn."""
        ps = self.page_size
        need_full = -(-(r.uncached_estimate + 1) // ps) + len(self.scheduler.running) + 1
        swa_cap = -(-(self.window + self.scheduler.config.chunk_tokens) // ps) + 2
        need_swa = min(need_full, swa_cap + len(self.scheduler.running))
        short_full = max(0, need_full - self.kv.full.num_free)
        short_swa = max(0, need_swa - self.kv.swa.num_free)
        if (short_full or short_swa) and self.tree is not None:
            if self.tree.evict(short_full, short_swa) != (0, 0):
                self.scheduler.tree_changed()
            short_full = max(0, need_full - self.kv.full.num_free)
            short_swa = max(0, need_swa - self.kv.swa.num_free)
        return not short_full and not short_swa or not self.scheduler.running

    def _admit(self, r: Request) -> None:
        ps, W = self.page_size, self.window
        if self.tree is None:
            r.kv = RequestKV(ps, W)
        else:
            m = self.tree.match(r.tokens())  # max_len defaults to len - 1: >= 1 token left
            self.tree.lock(m.node)
            r.lock_node = m.node
            first = max(0, (m.prefix_len - W) // ps)  # borrow SWA only for the locked window tail
            swa = [p if i >= first else None for i, p in enumerate(m.swa_pages)]
            r.kv = RequestKV.from_prefix(ps, W, m.prefix_len, m.full_pages, swa)
        if r.admitted_s is None:
            r.admitted_s = self.clock()
            r.cached_tokens = min(r.num_computed, len(r.prompt))
            self.metrics.inc("cached_prompt_tokens_total", r.cached_tokens)
        r.prefix_cached = False
        r.state = RequestState.RUNNING
        self.scheduler.waiting.remove(r)
        self.scheduler.running.append(r)

    def _reserve(self, r: Request, n: int, may_preempt: bool) -> bool:
        """Pages for r's next n tokens. False if it cannot have them now (r may be preempted)."""
        target = r.num_computed + n
        for _ in range(2 * len(self.scheduler.running) + 4):
            if r.kv.grow(self.kv, target):
                return True
            need = r.kv.pages_for(target) - r.kv.num_pages
            short_full = max(0, need - self.kv.full.num_free)
            short_swa = max(0, need - self.kv.swa.num_free)
            if self.tree is not None and self.tree.evict(short_full, short_swa) != (0, 0):
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
        """Last resort before preempting: drop every running request's own out-of-window SWA
        (those pages are then not cached, but nobody needs them to continue). The page of
        margin keeps the window before the last page boundary live for the tree."""
        margin = self.page_size if self.tree is not None else 0
        return sum(r.kv.free_swa_out_of_window(self.kv, r.num_computed - margin)
                   for r in self.scheduler.running)

    def _release(self, r: Request, preempted: bool) -> None:
        """Give back r's own pages and its lock; r goes back to the waiting queue."""
        r.kv.release(self.kv)
        if self.tree is not None:
            self.tree.unlock(r.lock_node)
        r.kv, r.lock_node, r.prefix_cached = None, None, False
        r.state = RequestState.WAITING
        self.scheduler.running.remove(r)
        self.scheduler.requeue(r)
        if preempted:
            r.preemptions += 1
            self._preemptions_left -= 1
            self.metrics.inc("preemptions_total")

    def _cache_prefix(self, r: Request) -> None:
        """The tree takes r's computed pages; r borrows them back under a lock at the new end.

        Called when a prefill completes (other requests can hit the prompt while r decodes)
        and again whenever decode has moved a window past the locked end: the lock pins the
        SWA of the W tokens before its node, so re-locking at the current end keeps the
        pinned SWA equal to the window r needs anyway (SGLang releases it instead)."""
        ps, kv, tree = self.page_size, r.kv, self.tree
        npages = r.num_computed // ps
        r.prefix_cached = True
        first = max(0, (npages * ps - self.window) // ps)
        if npages <= kv.owned_from or any(p is None for p in kv.swa_pages[first:npages]):
            return  # nothing new, or its window tail was dropped under pressure: not matchable
        tokens = r.tokens(npages * ps)
        tree.insert(tokens, kv.full_pages[:npages], kv.swa_pages[:npages])
        m = tree.match(tokens, max_len=len(tokens))
        assert m.prefix_len == npages * ps, f"inserted {npages * ps} tokens, matched {m.prefix_len}"
        tree.lock(m.node)
        tree.unlock(r.lock_node)
        r.lock_node = m.node
        kv.full_pages[:npages] = list(m.full_pages)
        kv.swa_pages[:npages] = [p if i >= first else None for i, p in enumerate(m.swa_pages)]
        kv.owned_from = npages
        self.scheduler.tree_changed()

    def _finish(self, r: Request, reason: str, finished: list[Request]) -> None:
        kv = r.kv
        if self.tree is not None:
            npages = r.num_computed // self.page_size
            if npages > kv.owned_from:
                self.tree.insert(r.tokens(npages * self.page_size), kv.full_pages[:npages], kv.swa_pages[:npages])
                kv.owned_from = npages  # the tree owns them now
                self.scheduler.tree_changed()
            kv.release(self.kv)
            self.tree.unlock(r.lock_node)
        else:
            kv.release(self.kv)
        r.kv, r.lock_node = None, None
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
            r.state, r.finish_reason, r.error, r.finished_s = RequestState.FINISHED, FINISH_ABORT, reason, self.clock()
            out.append(r)
        self.scheduler.waiting.clear()
        self._update_gauges()
        return out

    # ---- integrity and gauges ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pools, tree, and the engine's own rule: every used page has exactly one owner."""
        self.kv.check_integrity()
        owned_full: list[int] = []
        owned_swa: list[int] = []
        for r in self.scheduler.running:
            kv = r.kv
            assert r.state is RequestState.RUNNING and kv is not None
            assert kv.num_pages >= kv.pages_for(kv.num_tokens) and len(kv.swa_pages) == kv.num_pages
            owned_full += kv.full_pages[kv.owned_from:]
            owned_swa += [p for p in kv.swa_pages[kv.owned_from:] if p is not None]
            for p in kv.full_pages:
                assert self.kv.full.is_allocated(p), f"{r} references free full page {p}"
            start = max(0, (kv.num_tokens - self.window) // self.page_size)
            for p in kv.swa_pages[start:]:
                assert p is not None and self.kv.swa.is_allocated(p), f"{r} lost SWA of its window"
        tree_full, tree_swa = (0, 0)
        if self.tree is not None:
            self.tree.check_integrity(owned_full, owned_swa)
            tree_full, tree_swa = self.tree.cached_pages()
        assert len(set(owned_full)) == len(owned_full), "a full page is owned by two requests"
        assert len(set(owned_swa)) == len(owned_swa), "an SWA page is owned by two requests"
        assert self.kv.full.num_used == tree_full + len(owned_full), (
            f"full pages: {self.kv.full.num_used} used, tree {tree_full} + requests {len(owned_full)}")
        assert self.kv.swa.num_used == tree_swa + len(owned_swa), (
            f"swa pages: {self.kv.swa.num_used} used, tree {tree_swa} + requests {len(owned_swa)}")
        for r in self.scheduler.waiting:
            assert r.state is RequestState.WAITING and r.kv is None and r.lock_node is None

    def _update_gauges(self) -> None:
        tf, ts = self.tree.cached_pages() if self.tree is not None else (0, 0)
        self.metrics.set_gauges(
            waiting_requests=len(self.scheduler.waiting), running_requests=len(self.scheduler.running),
            full_pool_pages_used=self.kv.full.num_used, full_pool_pages_total=self.kv.full.num_pages,
            swa_pool_pages_used=self.kv.swa.num_used, swa_pool_pages_total=self.kv.swa.num_pages,
            tree_full_pages=tf, tree_swa_pages=ts)
