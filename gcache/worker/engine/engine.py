"""Continuous batching over the dual KV pools, with the prefix cache behind a CacheManager.

One step (Engine.step), top to bottom:
  receive      cache.poll(waiting): L3 prefetches start for queued requests;
  schedule     the Batcher (batcher.py): every decoding request gets its positions, then the
               scheduler's prefill chunks fill the rest of the token budget, admitting
               waiting requests on the way (cache.prepare_load; pages short: evict, trim
               SWA under pressure, preempt the most recently admitted request);
  forward      cache.start_loads(), then the decoding strategy's forward for the whole
               batch (decoding.py: plain; speculative.py: MTP drafts verified in it); layer
               i waits for its loads;
  postprocess  per request the strategy's Verdict, and one commit for every strategy:
               append its tokens up to a stop token or max_tokens, shrink the KV to them
               (rejected drafts), cache.trim_swa; after prefill and every ~W decoded
               tokens cache.prepare_write hands the computed pages to the cache (and the
               tiers below, per the write policy); TTFT; a stop token or max_tokens
               finishes the request (cache.prepare_write(final) + cache.release).
The engine is single-threaded: only its owner thread calls add_request/step (the cache's
L3 threads never touch the device pools).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.common.flags import flag
from gcache.worker.config import MTP_LAYERS_MAX
from gcache.worker.engine.batcher import Batcher
from gcache.worker.engine.decoding import Committed, DecodingContext, DecodingStrategy, PlainDecoding, Verdict
from gcache.worker.engine.metrics import EngineMetrics
from gcache.worker.engine.request import (
    FINISH_LENGTH,
    FINISH_STOP,
    FinishReason,
    Request,
    RequestState,
    SamplingParams,
)
from gcache.worker.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from gcache.worker.engine.speculative import MTPSpeculator
from gcache.worker.integrity import require
from gcache.worker.kvcache.cache_manager import CacheManager
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.prefix_cache_off import NoPrefixCache
from gcache.worker.kvcache.tiered_cache import TieredPrefixCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig

if TYPE_CHECKING:  # the model room sits beside the engine's, not below it
    from gcache.worker.kvcache.swa_tree.tree import SWARadixTree
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
    cache_config: TieredCacheConfig = field(default_factory=TieredCacheConfig)

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
        decoding: Callable[[DecodingContext], DecodingStrategy] | None = None,
    ) -> None:
        """decoding: builds the decoding strategy from the engine's parts (default: from
        config.mtp_layers / mtp_prefix; the benches pass their own baselines)."""
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
                TieredPrefixCache(kv, config.cache_config, nodes_max=config.tree_nodes_max)
                if config.prefix_cache
                else NoPrefixCache(kv)
            )
        self.cache = cache
        self.metrics = EngineMetrics()
        ctx = DecodingContext(model, kv, cache, self.metrics)
        self.decoding: DecodingStrategy = (decoding or self._default_decoding)(ctx)
        self.scheduler = Scheduler(config.scheduler, self.cache.estimate_uncached)
        self.batcher = Batcher(
            self.scheduler, cache, kv, self.decoding, self.metrics, clock, config.preemptions_per_step_max
        )
        self.last_step_ran = False
        self._update_gauges()

    def _default_decoding(self, ctx: DecodingContext) -> DecodingStrategy:
        """EngineConfig.mtp_layers > 0: MTP speculative decoding; else one token a step."""
        if self.config.mtp_layers:
            return MTPSpeculator(ctx, self.config.mtp_layers, self.config.mtp_prefix)
        return PlainDecoding(ctx)

    @property
    def tree(self) -> SWARadixTree | None:
        """The L1 prefix tree (None without a prefix cache)."""
        return self.cache.l1_tree()

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
                    req.rng.random()  # one draw per sampled token, as sample_token does
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
        return bool(self.scheduler.waiting or self.batcher.running)

    # ---- one step ------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it."""
        self.cache.poll(self.scheduler.waiting)  # receive: L3 prefetches for queued requests
        batch = self.batcher.schedule()  # admission, pages, preemption
        self.last_step_ran = bool(batch)
        finished = self._postprocess(batch, self._forward(batch)) if batch else []
        self._update_gauges()
        return finished

    def _forward(self, batch: list[tuple[Request, int]]) -> list[Any]:
        loads = self.cache.start_loads()  # layer by layer: layer i waits for its loads
        try:
            outs = self.decoding.forward(batch, self.kv, loads.wait_layer)
        finally:
            loads.finish()
        self.metrics.inc("steps_total")
        return outs

    def _postprocess(self, batch: list[tuple[Request, int]], outs: list[Any]) -> list[Request]:
        finished: list[Request] = []
        for (r, n), out in zip(batch, outs):
            verdict = self.decoding.verify(r, n, out)
            if self._commit(r, n, out, verdict):
                finished.append(r)
        return finished

    def _commit(self, r: Request, n: int, out: Any, v: Verdict) -> bool:
        """Append what the strategy vouched for, then the after-forward rules for plain and
        speculative decoding alike. True if r finished."""
        if not r.output or v.computed > 1:
            self.metrics.inc("prefill_tokens_computed_total", v.computed)
        if not v.tokens:  # mid-prefill: nothing to sample yet
            self.cache.trim_swa(r)
            return False
        emitted: list[int] = []
        for tok in v.tokens:  # a stop token or max_tokens ends the run early
            emitted.append(tok)
            if tok in r.params.stop_token_ids or len(r.output) + len(emitted) >= r.params.max_tokens:
                break
        # KV stays for the positions whose tokens are now committed (rejected drafts go)
        r.held_kv.shrink(self.kv, r.num_computed - v.drafted + len(emitted) - 1)
        self.cache.trim_swa(r)
        before = len(r.output)
        for tok, row in zip(emitted[:-1], v.rows):  # accepted drafts: their KV is computed
            self._append(r, tok, row)
        wrote = False
        if (
            not r.prefix_cached
            or r.num_computed - r.held_kv.owned_from * self.page_size >= self.window + 2 * self.page_size
        ):
            # After prefill, then every ~W decoded tokens: re-locking at the current end keeps
            # the SWA the lock pins equal to the window r needs anyway (SGLang releases it).
            # The cache sees r as after a plain step: KV for every token but the last.
            r.prefix_cached = True
            self.cache.prepare_write(r, final=False)
            self.scheduler.tree_changed()
            wrote = True
        self._append(r, emitted[-1], v.rows[len(emitted) - 1])
        if r.first_token_s is None:
            r.first_token_s = self.clock()
            self.metrics.observe_ttft(r.first_token_s - r.arrival_s)
        reason: FinishReason | None = None
        if emitted[-1] in r.params.stop_token_ids:
            reason = FINISH_STOP
        elif len(r.output) >= r.params.max_tokens:
            reason = FINISH_LENGTH
        self.decoding.after_commit(r, out, v, Committed(len(emitted), before, wrote, reason is not None))
        if reason is None:
            return False
        self.batcher.finish(r, reason)
        return True

    def _append(self, r: Request, tok: int, row: np.ndarray) -> None:
        if r.logits is not None:
            r.logits.append(np.array(row, dtype=np.float64))
        r.output.append(tok)
        self.metrics.inc("generation_tokens_total")

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

    def abort_all(self, reason: str = "engine stopped") -> list[Request]:
        """Finish every request with finish_reason 'abort' (shutdown)."""
        out = self.batcher.abort_all(reason)
        self._update_gauges()
        return out

    def finish_early(self, r: Request, reason: FinishReason = FINISH_STOP) -> bool:
        """Finish r now: a stop string matched (reason 'stop') or its client went away ('abort').
        A decoding request finishing with 'stop' ends as if it had sampled a stop token (its
        KV goes to the cache); any other running request gives its pages back; a waiting one
        leaves the queue. Only the engine's owner thread calls this, between steps.
        Returns False if r had already finished."""
        done = self.batcher.finish_early(r, reason)
        if done:
            self._update_gauges()
        return done

    def close(self) -> None:
        """Stop the cache's background threads (L3 writers and prefetchers)."""
        self.cache.close()

    # ---- integrity and gauges ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pools, every cache tier, and the engine's own rule: every used page has exactly
        one owner. Raises IntegrityError (also under python -O)."""
        self.kv.check_integrity()
        running = self.batcher.running
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
            running_requests=len(self.batcher.running),
            full_pool_pages_used=self.kv.full.num_used,
            full_pool_pages_total=self.kv.full.num_pages,
            swa_pool_pages_used=self.kv.swa.num_used,
            swa_pool_pages_total=self.kv.swa.num_pages,
            tree_full_pages=tf,
            tree_swa_pages=ts,
        )
        self.metrics.set_cache_stats(self.cache.stats())
