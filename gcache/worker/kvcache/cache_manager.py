"""The engine's prefix cache behind one contract (the way mini-sglang's kvcache/base.py does).

The engine never touches the prefix tree, the host pool or the store itself: it calls a
CacheManager at fixed points of its loop, and the manager owns every cached page in every
tier (L1 device pools via the SWA radix tree, L2 host pool, L3 GCache).

The contract is CacheManager's methods below (a docstring each); all calls come from the
engine thread, and `req.kv` is the request's page table. In the order of a step: poll,
match / estimate_uncached (the scheduler's key), ready, prepare_load at admission,
start_loads before the forward, prepare_write after it, trim_swa while it decodes, release
when it leaves; evict under pressure, check_integrity when idle.

Page ownership: pages [0, req.kv.owned_from) of a running request are the tree's (locked by
req.lock_node); every other page in req.kv is the request's own until prepare_write hands
it to the tree. Host pages are pinned while loaded, written to L3 or held for a prefetch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gcache.serving.checkpoints import CheckpointRule
from gcache.serving.tiers import TIERS, Tier

if TYPE_CHECKING:  # the engine room sits above this one: for annotations only
    from gcache.worker.engine.request import Request
    from gcache.worker.kvcache.swa_tree.node import TreeNode
    from gcache.worker.kvcache.swa_tree.tree import SWARadixTree
    from gcache.worker.kvcache.tiers.host_cache import HostCache
    from gcache.worker.kvcache.tiers.layer_load import LoadBatch
    from gcache.worker.kvcache.tiers.mtp_tails import MTPTails


@dataclass(frozen=True)
class MatchResult:
    """A prefix hit across tiers. Lengths are tokens, page-aligned, window-safe,
    cumulative: l1_len <= l2_len <= l3_len (L3 only once its prefetch completed)."""

    l1_len: int = 0
    l2_len: int = 0
    l3_len: int = 0
    device_pages: tuple = ()  # full-pool page ids of the L1 part
    host_keys: tuple = ()  # page hashes of the pages L2 serves (after L1)
    l3_keys: tuple = ()  # the subset of host_keys that came from L3
    node: TreeNode | None = None  # L1 lock handle
    present_len: int = 0  # tokens of the input present in L1, window-safe or not
    by_tier: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    @property
    def total(self) -> int:
        return max(self.l1_len, self.l2_len, self.l3_len)


class NoLoads:
    """A load batch with nothing in it (the shape start_loads returns: wait_layer, finish)."""

    def wait_layer(self, layer: int) -> None:
        """Block until layer's KV of the batch's loads is on the device."""
        return None

    def finish(self) -> None:
        """After the forward: wait for every copy and give back what the loads pinned."""
        return None


class CacheManager(ABC):
    """Owns every cached page in every tier; the engine's only way to the prefix cache."""

    mtp: MTPTails | None = None  # the `mtp` pool (kvcache.tiers.mtp_tails.MTPTails) where the cache has one
    # Where the cache keeps SWA checkpoints (every C pages, ends, branch points); None: it keeps
    # none. The MTP tails are written at the same points (Speculator).
    checkpoint_rule: CheckpointRule | None = None

    @abstractmethod
    def match(self, req: Request) -> MatchResult:
        """How much of req's tokens (always leaving >= 1 to compute) is loadable, per tier,
        right now. Takes no lock, allocates nothing, changes nothing."""

    @abstractmethod
    def ready(self, req: Request) -> bool:
        """May the scheduler admit waiting req now? (the prefetch policy: a waiting request's
        L3 prefetch runs while it queues)."""

    @abstractmethod
    def poll(self, waiting: Iterable[Request]) -> None:
        """Background hook, once per step before scheduling: start L3 prefetches for waiting
        requests (bounded per step)."""

    @abstractmethod
    def prepare_load(self, req: Request) -> MatchResult:
        """At admission: lock the L1 match, allocate device pages for the part that comes from
        L2/L3 (cut to what fits at a window-safe point) and queue its copies; sets req.kv,
        req.lock_node, req.branch_page. Returns a MatchResult whose per-tier lengths are what
        req actually got."""

    @abstractmethod
    def start_loads(self) -> LoadBatch | NoLoads:
        """Start the copies queued since the last call, layer by layer: the forward calls
        wait_layer(i) before layer i and finish() after it."""

    @abstractmethod
    def prepare_write(self, req: Request, final: bool) -> None:
        """After a forward: req's computed, page-aligned prefix goes into the L1 tree (req
        borrows it back under a new lock unless final) and, per the write policy, to L2 and
        L3 (L3 off the critical path)."""

    @abstractmethod
    def lock(self, node) -> None:
        """Pin an L1 prefix (a MatchResult's node) against eviction."""

    @abstractmethod
    def unlock(self, node) -> None:
        """Undo one lock(node)."""

    @abstractmethod
    def release(self, req: Request) -> None:
        """req leaves the running list (preemption, abort, finish): give back its own pages
        and its lock; sets req.kv and req.lock_node to None."""

    @abstractmethod
    def evict(self, full_pages: int, swa_pages: int) -> tuple[int, int]:
        """Free at least that many unlocked device pages of the cache, if it can; returns
        the (full, swa) pages freed."""

    @abstractmethod
    def trim_swa(self, req: Request, pressure: bool = False) -> int:
        """Free req's own SWA pages it no longer needs: out of the window and (unless under
        pressure) not in a checkpoint tail. Returns the pages freed."""

    @abstractmethod
    def estimate_uncached(self, req: Request) -> int:
        """Tokens req would still compute if admitted now (the scheduler's ordering key)."""

    @abstractmethod
    def check_integrity(self, running: Iterable[Request], waiting: Iterable[Request] = ()) -> None:
        """Raise IntegrityError if any invariant of any tier is broken (page ownership
        against the running and waiting requests, pool accounting, the trees)."""

    def drop_waiting(self, req: Request) -> None:
        """A waiting request leaves without running (abort): drop what it holds here."""
        return None

    def cached_pages(self) -> tuple[int, int]:
        """(full, swa) device pages the cache owns (not counting requests' own)."""
        return 0, 0

    def prefix_swa_pages(self, req: Request) -> list:
        """Read-only SWA page ids (None: not live) of req's pages, its own and the cache's
        live ones before its window (spare pages in L1): valid until the next call into the
        cache. The MTP rebuild reads them (MTPSpeculator._new_state)."""
        return list(req.held_kv.swa_pages)

    def stats(self) -> dict:
        """Counters and gauges for /metrics (names without prefix)."""
        return {}

    # ---- engine thread only: the tiers' own objects and entries ------------------------------
    def l1_tree(self) -> SWARadixTree | None:
        """The L1 prefix tree (None without one): the router publisher observes it."""
        return None

    def l2_cache(self) -> HostCache | None:
        """The L2 host cache (None without one): the router publisher observes it."""
        return None

    def stored_in_l3(self, keys: Sequence[str], swa_lo: int) -> tuple[int, bool]:
        """(leading pages of `keys` whose KV is in L3: full, and SWA from swa_lo on; whether
        any page is still queued for L3). The PD prefill asks it through the engine thread
        (EngineThread.ask_stored_in_l3): cache entries are read on the engine thread only."""
        return 0, False

    # ---- any thread: what the worker's outside asks (reads no cache entry) -------------------
    def start(self) -> None:
        """The worker serves: start background work (probe the L3 store, so an unreachable one
        is logged now and again when it answers, and watch its health)."""
        return None

    def l3_available(self) -> bool:
        """Whether an L3 store is configured and believed reachable now (its breaker)."""
        return False

    def l3_health(self) -> dict | None:
        """The L3 store's health for /health (None without an L3)."""
        return None

    def l2_bytes(self) -> int:
        """Bytes of the L2 host pool (0 without one)."""
        return 0

    def key_model(self) -> str:
        """The model name the cache's L3 keys carry ("" where it keys none)."""
        return ""

    def close(self) -> None:
        """Stop background threads (L3 writers, prefetchers)."""
        return None
