"""The simulated parts of bench/hicache/hierarchy.py; everything else (Engine, scheduler, SWA radix
tree, device pools, HostCache, L3Store, gcache.Client, gcache-server) is real.

  ScriptedModel     SimulatedModel whose greedy output is the workload's answer, and which
                    also charges the virtual clock for host -> device KV loads.
  BenchTieredCache      TieredPrefixCache whose prefetch policy runs on the virtual clock: an L3 prefetch
                    started at virtual time t is done at t + its modelled read time; L3 work
                    is serialised in real time so runs are reproducible.
  CountingClient    the real gcache.Client, counting what is written to L3 (distinct keys).
  Timing            the bandwidths and round trip those charges use (measured per run).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from gcache.common.attention import AttentionKind
from gcache.serving.swa_window import tail_start_page
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_cache import TieredPrefixCache
from gcache.worker.model.sim import SimulatedModel


@dataclass(frozen=True)
class Timing:
    h2d_bytes_per_s: float  # host -> device copy (measured: one large numpy copy)
    l3_bytes_per_s: float  # loopback GET throughput from the L3 gcache-server
    l3_rtt_s: float  # one small round trip to it (exists of one key)

    def load_s(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    def l3_read_s(self, nbytes: int, round_trips: int) -> float:
        return round_trips * self.l3_rtt_s + nbytes / self.l3_bytes_per_s


class ScriptedModel(SimulatedModel):
    """Greedy sampling emits `answers[rid]` token by token (the last prompt position's
    logits pick answer[0], and so on); requests without an answer get SimulatedModel's
    text-like ids. The compute cost is SimulatedModel's; the bytes the cache copied host ->
    device for this step are charged on top, serially (no overlap credit)."""

    def __init__(self, config, clock, cost, timing: Timing) -> None:
        super().__init__(config, clock, cost)
        self.timing = timing
        self.answers: dict[int, np.ndarray] = {}
        self.engine = None
        self._loaded_seen = 0
        self.load_s = 0.0

    def attach(self, engine) -> None:
        self.engine = engine

    def forward_batch(self, chunks, kv, all_logits: bool = False, layer_ready=None) -> list:
        by_kv = {id(r.kv): r for r in self.engine.batcher.running}
        reqs = [by_kv[id(c[2])] for c in chunks]
        cache = self.engine.cache
        loaded = cache.cache_stats.counters["l2_load_bytes"] if isinstance(cache, TieredPrefixCache) else 0
        if loaded > self._loaded_seen:
            t = self.timing.load_s(loaded - self._loaded_seen)
            self.clock.advance(t)
            self.load_s += t
            self._loaded_seen = loaded
        out = super().forward_batch(chunks, kv, all_logits, layer_ready)
        for (_, _, rkv), r, logits in zip(chunks, reqs, out):
            answer = self.answers.get(r.rid)
            i = rkv.num_tokens - len(r.prompt)  # next token's index in the answer
            if answer is not None and 0 <= i < len(answer):
                logits[:] = 0.0
                logits[0, int(answer[i])] = 1.0
        return out


class BenchTieredCache(TieredPrefixCache):
    """TieredPrefixCache with the wait_complete prefetch policy on the virtual clock: a waiting
    request is ready once its real prefetch finished AND the virtual clock passed
    (virtual start + modelled read time: round trips + bytes / measured GET throughput).
    `tree_cls` swaps the L1 tree before any request (the SGLang-style baseline)."""

    def __init__(
        self, kv: DualKVCache, config, clock, timing: Timing, nodes_max: int = 1_000_000, l3_client=None, tree_cls=None
    ) -> None:
        super().__init__(kv, config, nodes_max=nodes_max, l3_client=l3_client)
        if tree_cls is not None:
            on_evict = self.tree.on_evict
            self.tree = tree_cls(self.ps, self.window, kv.full, kv.swa, nodes_max=nodes_max)
            self.tree.on_evict = on_evict
        self.clock, self.timing = clock, timing
        self.l3_read_s = 0.0

    def stats(self) -> dict:
        """The engine refreshes its gauges from stats() every step, and TieredPrefixCache.stats()
        counts pinned L2 pages by scanning every L2 entry (O(L2) per step: a third of this
        bench's wall time). The bench reads the full stats once per run instead."""
        return {}

    def full_stats(self) -> dict:
        return super().stats()

    def poll(self, waiting) -> None:
        """One prefetch at a time, each waited for (real time) before the next and before
        the step writes anything: two prefetch threads, or a prefetch and this step's L3
        writes, would otherwise race and make runs irreproducible."""
        started = 0
        for r in list(waiting):
            if started >= self.config.prefetches_per_step:
                break
            if r.prefetch is not None or r.prefetch_tried:
                continue
            super().poll([r])
            if r.prefetch is not None:
                r.prefetch.vstart = self.clock()
                started += 1
                self.wait_l3()

    def _write_l3(self, chain) -> None:
        """L3 writes cost no virtual time (they are off the critical path), but they are
        waited for in real time, so the pins they hold on L2 pages never race with this
        engine's L2 evictions (determinism)."""
        super()._write_l3(chain)
        self.wait_l3()

    def wait_l3(self, timeout_s: float = 60.0) -> None:
        """Until every queued L3 write and prefetch has finished (bounded)."""
        if self.l3 is None or self.l3.idle():
            return
        deadline = time.monotonic() + timeout_s
        while not self.l3.idle():
            if time.monotonic() > deadline:
                raise RuntimeError(f"L3 writes/prefetches did not finish within {timeout_s}s: {self.full_stats()}")
            time.sleep(0.0002)

    def ready(self, req) -> bool:
        pf = req.prefetch
        if pf is None:
            return True
        if not pf.done.is_set():
            return False
        return self.clock() >= self._ready_at(pf)

    def _ready_at(self, pf) -> float:
        if not hasattr(pf, "vdone"):
            full = len(pf.fetched)
            tail = max(pf.start, tail_start_page(pf.ready_end, self.ps, self.window))
            swa = sum(1 for k in pf.keys[tail : pf.ready_end] if k in pf.fetched)
            nbytes = full * self.kv.bytes_per_page(AttentionKind.FULL) + swa * self.kv.bytes_per_page(AttentionKind.SWA)
            t = self.timing.l3_read_s(nbytes, 3 if full else 1)  # exists, exists(swa), get
            pf.vdone = pf.vstart + t
            self.l3_read_s += t
        return pf.vdone

    def next_ready_s(self, waiting) -> float | None:
        """Earliest virtual time a waiting request's finished prefetch makes it ready."""
        times = [self._ready_at(r.prefetch) for r in waiting if r.prefetch is not None and r.prefetch.done.is_set()]
        return min(times) if times else None


class CountingClient:
    """gcache.Client that records the distinct keys stored in L3, full and SWA apart
    (told by their sizes). Thread-safe (the L3 writer thread calls it)."""

    def __init__(self, client, full_bytes: int, swa_bytes: int) -> None:
        self._client = client
        self._sizes = (full_bytes, swa_bytes)
        self._lock = threading.Lock()
        self.keys = {"full": set(), "swa": set()}  # distinct keys stored, by pool

    def __getattr__(self, name):
        return getattr(self._client, name)

    def batch_put_from(self, keys, buffers, sizes=None, offsets=None):
        ok = self._client.batch_put_from(keys, buffers, sizes=sizes, offsets=offsets)
        with self._lock:
            for k, size, stored in zip(keys, sizes, ok):
                if stored:
                    self.keys["full" if size == self._sizes[0] else "swa"].add(k)
        return ok
