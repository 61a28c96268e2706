"""The engine's prefix cache behind one contract (the way mini-sglang's kvcache/base.py does).

The engine never touches the prefix tree, the host pool or the store itself: it calls a
CacheManager at fixed points of its loop, and the manager owns every cached page in every
tier (L1 device pools via the SWA radix tree, L2 host pool, L3 GCache).

Contract (all calls come from the engine thread; `req.kv` is the request's page table):
  match(req)          -> MatchResult: how much of req's tokens (leaving >= 1 to compute) is
                         loadable, per tier, right now. Takes no lock, allocates nothing.
  ready(req)          -> may the scheduler admit req now? (the prefetch policy: a waiting
                         request's L3 prefetch runs while it queues)
  poll(waiting)       -> background hook once per step: start L3 prefetches for waiting
                         requests (bounded per step).
  prepare_load(req)   -> at admission: lock the L1 match, allocate device pages for the part
                         that comes from L2/L3 (chunked to what fits) and queue its copies;
                         sets req.kv, req.lock_node, req.branch_page; returns a MatchResult
                         whose per-tier lengths are what req actually got.
  start_loads()       -> the queued copies, started layer by layer; the forward waits on
                         `wait_layer(i)` before layer i and calls `finish()` after.
  prepare_write(req, final) -> the computed, page-aligned prefix goes into the L1 tree (req
                         borrows it back under a new lock unless final) and, per the write
                         policy, to L2 and L3 (L3 off the critical path).
  lock(node) / unlock(node) -> pin / unpin an L1 prefix (a MatchResult's node).
  release(req)        -> give back req's own pages and its lock (preemption, abort, finish).
  evict(full, swa)    -> free at least that many unlocked device pages; (full, swa) freed.
  trim_swa(req, pressure) -> free req's own SWA pages it no longer needs: out of the
                         window and (unless under pressure) not in a checkpoint tail.
  estimate_uncached(req) -> tokens req would still compute (the scheduler's key).
  check_integrity(running, waiting) -> raise IntegrityError if any invariant of any tier is broken.
  drop_waiting(req)   -> a waiting request is aborted: release its prefetch.
  close()             -> stop background threads.

Page ownership: pages [0, req.kv.owned_from) of a running request are the tree's (locked by
req.lock_node); every other page in req.kv is the request's own until prepare_write hands
it to the tree. Host pages are pinned while loaded, written to L3 or held for a prefetch.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class Tier(enum.StrEnum):
    """A level of the hierarchy; the values are the keys of cached_tokens_by_tier and the
    origin of a host page."""

    L1 = "l1"  # device pools, the SWA radix tree
    L2 = "l2"  # the host pool
    L3 = "l3"  # GCache


TIERS = tuple(Tier)


@dataclass(frozen=True)
class MatchResult:
    """A prefix hit across tiers. Lengths are tokens, page-aligned, window-safe,
    cumulative: l1_len <= l2_len <= l3_len (L3 only once its prefetch completed)."""

    l1_len: int = 0
    l2_len: int = 0
    l3_len: int = 0
    device_pages: tuple = ()      # full-pool page ids of the L1 part
    host_keys: tuple = ()         # page hashes of the pages L2 serves (after L1)
    l3_keys: tuple = ()           # the subset of host_keys that came from L3
    node: object = None           # L1 lock handle
    present_len: int = 0          # tokens of the input present in L1, window-safe or not
    by_tier: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    @property
    def total(self) -> int:
        return max(self.l1_len, self.l2_len, self.l3_len)


class NoLoads:
    """A load batch with nothing in it."""

    def wait_layer(self, layer: int) -> None:
        return None

    def finish(self) -> None:
        return None


class CacheManager(ABC):
    @abstractmethod
    def match(self, req) -> MatchResult: ...

    @abstractmethod
    def ready(self, req) -> bool: ...

    @abstractmethod
    def poll(self, waiting) -> None: ...

    @abstractmethod
    def prepare_load(self, req) -> MatchResult: ...

    @abstractmethod
    def start_loads(self): ...

    @abstractmethod
    def prepare_write(self, req, final: bool) -> None: ...

    @abstractmethod
    def lock(self, node) -> None: ...

    @abstractmethod
    def unlock(self, node) -> None: ...

    @abstractmethod
    def release(self, req) -> None: ...

    @abstractmethod
    def evict(self, full_pages: int, swa_pages: int) -> tuple[int, int]: ...

    @abstractmethod
    def trim_swa(self, req, pressure: bool = False) -> int: ...

    @abstractmethod
    def estimate_uncached(self, req) -> int: ...

    @abstractmethod
    def check_integrity(self, running, waiting=()) -> None: ...

    def drop_waiting(self, req) -> None:
        """A waiting request leaves without running (abort): drop what it holds here."""
        return None

    def cached_pages(self) -> tuple[int, int]:
        """(full, swa) device pages the cache owns (not counting requests' own)."""
        return 0, 0

    def stats(self) -> dict:
        """Counters and gauges for /metrics (names without prefix)."""
        return {}

    def close(self) -> None:
        return None
