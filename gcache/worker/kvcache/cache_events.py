"""Which pages the worker's cache holds, per tier, as a router needs it: collected by cheap
hooks on the L1 tree and the L2 host cache, handed to the publisher in batches.

A mirror maps page id -> flags (L1/L2 full and SWA bits, gcache.serving.redis_layout); every hook
updates it and marks the page dirty. The dirty set is bounded (events_max): when it is full,
further changes are dropped and counted, and the next batch is a full snapshot of the mirror
instead of a delta, so drops heal. `rebuild()` recomputes the mirror from the real tree and
host cache (at attach time and periodically) and reports any drift.

Threads: tree hooks run in the engine thread; host hooks also run on L3 prefetch / writer
threads, under the host cache's lock. Everything here takes one short lock of its own, after
the host's (never the other way round).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gcache.serving.redis_layout import L1_FULL, L1_SWA, L2_FULL, L2_SWA, L3_FULL, L3_SWA, page_id
from gcache.worker.kvcache.cache_manager import CacheManager
from gcache.worker.kvcache.swa_tree.tree import SWARadixTree
from gcache.worker.kvcache.tiers.host_cache import HostCache

L1_BITS, L2_BITS = L1_FULL | L1_SWA, L2_FULL | L2_SWA


@dataclass
class Batch:
    full: bool  # a whole snapshot (replace everything) or a delta
    pages: list  # (page id, flags) — flags 0 = gone
    l3: list  # (page id, L3_FULL | L3_SWA) newly known to be in L3


class CacheEventLog:
    def __init__(self, events_max: int = 65536) -> None:
        if not 1 <= events_max <= 1 << 26:
            raise ValueError("events_max must be in [1, 2^26]")
        self.events_max = events_max
        self.lock = threading.Lock()
        self.mirror: dict[int, int] = {}
        self.dirty: dict[int, None] = {}
        self.l3: dict[int, int] = {}
        self.resync = True  # the first batch is a snapshot
        self.stats = dict.fromkeys(("events", "dropped", "l3_dropped", "snapshots", "deltas", "drift", "rebuilds"), 0)
        self.tree: SWARadixTree | None = None
        self.host: HostCache | None = None

    # ---- attach / detach (engine thread) ------------------------------------------------------
    def attach(self, cache: CacheManager) -> None:
        """Start observing `cache` (its L1 tree and L2 host cache; a cache without them
        publishes nothing)."""
        self.tree = cache.l1_tree()
        self.host = cache.l2_cache()
        self.rebuild(attach=True)

    def detach(self) -> None:
        for obj in (self.tree, self.host):
            if obj is not None and self in obj.observers:
                obj.observers.remove(self)

    def rebuild(self, attach: bool = False) -> int:
        """Mirror := what the tree and the host cache hold now; next batch is a snapshot.
        Returns how many pages the old mirror had wrong (0 unless an event was missed)."""
        fresh: dict[int, int] = {}
        if self.tree is not None:
            stack = list(self.tree.root.children.values())
            while stack:
                n = stack.pop()
                for k, s in zip(n.keys, n.swa):
                    fresh[page_id(k)] = L1_FULL | (L1_SWA if s is not None else 0)
                stack.extend(n.children.values())
            if attach:
                self.tree.observers.append(self)
        host_lock = self.host.lock if self.host is not None else threading.Lock()
        with host_lock:  # host hooks fire under this lock: no change slips between walk and attach
            if self.host is not None:
                for k, e in self.host.entries.items():
                    pid = page_id(k)
                    fresh[pid] = fresh.get(pid, 0) | L2_FULL | (L2_SWA if e.swa is not None else 0)
                if attach:
                    self.host.observers.append(self)
            with self.lock:
                drift = (
                    0
                    if attach
                    else sum(1 for k in fresh.keys() | self.mirror.keys() if fresh.get(k, 0) != self.mirror.get(k, 0))
                )
                self.mirror = fresh
                self.dirty.clear()
                self.resync = True
                self.stats["drift"] += drift
                self.stats["rebuilds"] += 1
        return drift

    # ---- hooks -------------------------------------------------------------------------------
    def _set(self, pid: int, clear: int, add: int) -> None:
        """Caller holds self.lock."""
        old = self.mirror.get(pid, 0)
        new = (old & ~clear) | add
        if new == old:
            return
        if new:
            self.mirror[pid] = new
        else:
            del self.mirror[pid]
        self.stats["events"] += 1
        if self.resync or pid in self.dirty:
            return
        if len(self.dirty) >= self.events_max:
            self.stats["dropped"] += 1
            self.resync = True  # the next batch is a snapshot of the mirror
            self.dirty.clear()
            return
        self.dirty[pid] = None

    def pages_stored(self, keys, swa_live) -> None:
        """Tree: these pages (or their SWA KV) entered L1."""
        with self.lock:
            for k, live in zip(keys, swa_live):
                self._set(page_id(k), 0, L1_FULL | (L1_SWA if live else 0))

    def pages_evicted(self, keys, full_ids, swa_ids) -> None:
        """Tree: these pages leave L1 (full id given) or lose their SWA KV (full id None)."""
        with self.lock:
            for k, f in zip(keys, full_ids):
                self._set(page_id(k), L1_BITS if f is not None else L1_SWA, 0)

    def host_changed(self, key: str, has_full: bool, has_swa: bool) -> None:
        """Host cache: the L2 entry of `key` now holds this (both False: gone)."""
        with self.lock:
            self._set(page_id(key), L2_BITS, (L2_FULL if has_full else 0) | (L2_SWA if has_full and has_swa else 0))

    def l3_stored(self, key: str, has_swa: bool) -> None:
        """Host cache: `key` is known to be in L3 (written there or read from there)."""
        with self.lock:
            pid = page_id(key)
            if pid not in self.l3 and len(self.l3) >= self.events_max:
                self.stats["l3_dropped"] += 1
                return
            self.l3[pid] = self.l3.get(pid, 0) | L3_FULL | (L3_SWA if has_swa else 0)

    # ---- the publisher's side --------------------------------------------------------------------
    def take(self) -> Batch:
        """What changed since the last take (or everything, after a resync)."""
        with self.lock:
            if self.resync:
                batch = Batch(True, list(self.mirror.items()), list(self.l3.items()))
                self.resync = False
                self.stats["snapshots"] += 1
            else:
                get = self.mirror.get
                batch = Batch(False, [(pid, get(pid, 0)) for pid in self.dirty], list(self.l3.items()))
                if batch.pages:
                    self.stats["deltas"] += 1
            self.dirty.clear()
            self.l3.clear()
            return batch

    def failed(self, batch: Batch) -> None:
        """A taken batch did not reach Redis: resend everything next time (Redis may even have
        restarted empty). L3 reports are hints: dropped."""
        with self.lock:
            self.resync = True
            self.dirty.clear()
            self.stats["l3_dropped"] += len(batch.l3)

    def pending(self) -> int:
        with self.lock:
            return len(self.dirty) + len(self.l3)
