"""L2 index: which page hash lives in which host slot, pins, and LRU eviction.

Keys are the page-hash chain (gcache.wire.keys), so a dict keyed by hash is a prefix index: a
prefix of a sequence is present exactly when the hashes of its pages are. Every entry has
its full-attention page; SWA pages exist only at checkpoints (the window tails of request
ends, branch points and every C pages), so the SWA cost of a cached prefix stays O(W).

Pins: a page being loaded to the device, written to L3 or held for a waiting request's
prefetch is pinned and never evicted (failure mode 1 of the production report). Slots
being filled (an L3 read in flight) are reserved and belong to no entry until published.

Eviction order is LRU, and a hit touches a chain suffix-first, so its page 0 ends up the
most recent: a chain's prefix pages outlive its suffix pages (failure mode 3: a chain
whose page 0 is gone is worthless, however many later pages remain).

Thread-safe: the engine thread, L3 writer threads and prefetch threads all use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gcache.common.attention import AttentionKind
from gcache.serving.tiers import Tier
from gcache.worker.integrity import require
from gcache.worker.kvcache.tiers.host_pool import HostKVPool


@dataclass
class HostPage:
    full: int  # slot in the host full pool
    swa: int | None = None  # slot in the host SWA pool (checkpoint tails only)
    pins: int = 0
    origin: Tier = Tier.L1  # L1: written from the device; L3: read from GCache
    in_l3: bool = False  # known to be in L3 (written there or read from there)
    l3_queued: bool = False  # an L3 write of it is queued or running


class HostCache:
    def __init__(self, pool: HostKVPool, protect_prefix: bool = True, honor_pins: bool = True) -> None:
        self.pool = pool
        self.protect_prefix = protect_prefix
        self.honor_pins = honor_pins  # False only in the regression test of failure mode 1
        self.lock = threading.Lock()
        self.entries: OrderedDict[str, HostPage] = OrderedDict()  # oldest first
        self._reserved: dict[AttentionKind, set[int]] = {AttentionKind.FULL: set(), AttentionKind.SWA: set()}
        self._pinned = 0  # entries with pins > 0 (a gauge read every engine step: no scan)
        self.stats = {"evicted_full": 0, "evicted_swa": 0, "reserve_failures": 0, "published": 0}
        # Observers of which pages L2 holds (the router publisher), called under self.lock:
        # obs.host_changed(key, has_full, has_swa) after an entry changed, obs.l3_stored(key,
        # has_swa) once a page is known to be in L3. Cheap, never call back into this cache.
        self.observers: list = []

    # ---- lookups ---------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        with self.lock:
            return key in self.entries

    def get(self, key: str) -> HostPage | None:
        with self.lock:
            return self.entries.get(key)

    def run(self, keys: list[str], start: int) -> tuple[int, list[bool]]:
        """(pages present with full KV from keys[start] on without a gap, SWA present per page)."""
        n, swa = 0, []
        with self.lock:
            for k in keys[start:]:
                e = self.entries.get(k)
                if e is None:
                    break
                n += 1
                swa.append(e.swa is not None)
        return n, swa

    def touch_chain(self, keys: list[str]) -> None:
        """Most recent for these pages, page 0 last (so most recent of all) unless
        protect_prefix is off (then suffix-first aging, the plain LRU order of a scan)."""
        order = reversed(keys) if self.protect_prefix else keys
        with self.lock:
            for k in order:
                if k in self.entries:
                    self.entries.move_to_end(k)

    # ---- pins ------------------------------------------------------------------------------
    def pin(self, keys: list[str]) -> list[str]:
        """Pin the present ones; returns the keys pinned (unpin exactly those)."""
        out = []
        with self.lock:
            for k in keys:
                e = self.entries.get(k)
                if e is not None:
                    self._pin(e)
                    out.append(k)
        return out

    def unpin(self, keys: list[str]) -> None:
        with self.lock:
            for k in keys:
                e = self.entries.get(k)
                if not self.honor_pins and (e is None or not e.pins):
                    continue  # evicted under a pin: only the failure-mode-1 test does this
                require(e is not None and e.pins > 0, f"unpin of an unpinned host page {k[:12]}")
                if e is None:  # cannot happen: for the type checker: require raised otherwise
                    raise RuntimeError("invariant broken: for the type checker: require raised otherwise")
                self._unpin(e)

    # ---- slots -----------------------------------------------------------------------------
    def reserve(self, kind: AttentionKind, n: int) -> list[int] | None:
        """n free slots of `kind`, evicting unpinned LRU pages; None (nothing changes but
        evictions) if pinned pages leave too little room. Publish or cancel them."""
        pool = self.pool.pools[kind]
        with self.lock:
            if pool.num_free < n:
                self._evict(kind, n - pool.num_free)
            slots = pool.alloc(n)
            if slots is None:
                self.stats["reserve_failures"] += 1
                return None
            self._reserved[kind].update(slots)
            return slots

    def cancel(self, kind: AttentionKind, slots: list[int]) -> None:
        with self.lock:
            self._reserved[kind].difference_update(slots)
            self.pool.pools[kind].free(slots)

    def publish(
        self, key: str, full: int | None, swa: int | None, origin: Tier, in_l3: bool = False, pin: bool = False
    ) -> bool:
        """Hand reserved slots to the entry of `key`. A slot that duplicates what the entry
        already holds goes back to the pool. An SWA page without a full page to hang on is
        dropped. Returns whether the entry exists afterwards (pinned once more if pin)."""
        with self.lock:
            for kind, slot in ((AttentionKind.FULL, full), (AttentionKind.SWA, swa)):
                if slot is not None:
                    self._reserved[kind].remove(slot)
            e = self.entries.get(key)
            give_back: dict[AttentionKind, list[int]] = {AttentionKind.FULL: [], AttentionKind.SWA: []}
            if e is None:
                if full is None:
                    if swa is not None:
                        give_back[AttentionKind.SWA].append(swa)
                    self._free(give_back)
                    return False
                e = self.entries[key] = HostPage(full, swa, origin=origin, in_l3=in_l3)
                self.stats["published"] += 1
            else:
                if full is not None:
                    give_back[AttentionKind.FULL].append(full)
                if swa is not None:
                    if e.swa is None:
                        e.swa = swa
                        e.in_l3 = in_l3  # L3 has this page's full KV, not yet its SWA
                    else:
                        give_back[AttentionKind.SWA].append(swa)
                if full is not None:
                    e.in_l3 = e.in_l3 or in_l3
            self.entries.move_to_end(key)
            if pin:
                self._pin(e)
            self._free(give_back)
            for obs in self.observers:
                obs.host_changed(key, True, e.swa is not None)
                if in_l3:
                    obs.l3_stored(key, e.swa is not None and swa is not None)
            return True

    def claim_for_l3(self, keys: list[str]) -> list[tuple[str, int, int | None]]:
        """The pages of `keys` present here, not in L3 and not queued for it, as
        (key, full slot, swa slot): marked queued and pinned for the L3 writer (the pin keeps
        the slots theirs until the write is done), handed back with finish_l3."""
        out = []
        with self.lock:
            for k in keys:
                e = self.entries.get(k)
                if e is not None and not e.in_l3 and not e.l3_queued:
                    e.l3_queued = True
                    self._pin(e)
                    out.append((k, e.full, e.swa))
        return out

    def finish_l3(self, keys: list[str], stored: bool) -> None:
        with self.lock:
            for k in keys:
                e = self.entries.get(k)
                if e is None and not self.honor_pins:
                    continue  # evicted under a pin: only the failure-mode-1 test does this
                require(e is not None and e.pins > 0 and e.l3_queued, f"finish_l3 of a page not queued for L3 {k[:12]}")
                if e is None:  # cannot happen: for the type checker: require raised otherwise
                    raise RuntimeError("invariant broken: for the type checker: require raised otherwise")
                self._unpin(e)
                e.l3_queued = False
                e.in_l3 = e.in_l3 or stored
                if stored:
                    for obs in self.observers:
                        obs.l3_stored(k, e.swa is not None)

    def _free(self, slots: dict) -> None:
        for kind, lst in slots.items():
            if lst:
                self.pool.pools[kind].free(lst)

    def _evict(self, kind: AttentionKind, needed: int) -> None:
        """Free `needed` slots of `kind` from unpinned pages, oldest first (caller holds lock).
        A full slot goes with its whole entry; an SWA slot alone turns the entry full-only."""
        freed = 0
        for key in list(self.entries):
            if freed >= needed:
                return
            e = self.entries[key]
            if e.pins and self.honor_pins:
                continue
            if kind == AttentionKind.FULL:
                if e.pins:  # honor_pins is off (failure-mode-1 test only)
                    self._pinned -= 1
                del self.entries[key]
                self.pool.pools[AttentionKind.FULL].free([e.full])
                if e.swa is not None:
                    self.pool.pools[AttentionKind.SWA].free([e.swa])
                    self.stats["evicted_swa"] += 1
                self.stats["evicted_full"] += 1
                freed += 1
                for obs in self.observers:
                    obs.host_changed(key, False, False)
            elif e.swa is not None:
                self.pool.pools[AttentionKind.SWA].free([e.swa])
                e.swa = None
                self.stats["evicted_swa"] += 1
                freed += 1
                for obs in self.observers:
                    obs.host_changed(key, True, False)

    # ---- integrity -------------------------------------------------------------------------
    def _pin(self, e: HostPage) -> None:
        e.pins += 1
        self._pinned += e.pins == 1

    def _unpin(self, e: HostPage) -> None:
        e.pins -= 1
        self._pinned -= e.pins == 0

    def pinned_pages(self) -> int:
        return self._pinned

    def pins(self) -> dict:
        with self.lock:
            return {k: e.pins for k, e in self.entries.items() if e.pins}

    def used_pages(self) -> tuple[int, int]:
        with self.lock:
            return self.pool.pools[AttentionKind.FULL].num_used, self.pool.pools[AttentionKind.SWA].num_used

    def check_integrity(self, expect_unpinned: bool = False) -> None:
        """Every host slot is free, reserved or held by exactly one entry; pins >= 0 (and 0
        everywhere when the caller knows nothing is in flight)."""
        with self.lock:
            for kind in (AttentionKind.FULL, AttentionKind.SWA):
                pool = self.pool.pools[kind]
                pool.check_integrity()
                held = [e.full if kind == AttentionKind.FULL else e.swa for e in self.entries.values()]
                held = [s for s in held if s is not None]
                require(len(held) == len(set(held)), f"a host {kind} slot is held by two pages")
                reserved = self._reserved[kind]
                require(not reserved & set(held), f"a reserved host {kind} slot is also published")
                allocated = {p for p in range(pool.num_pages) if pool.is_allocated(p)}
                require(
                    allocated == set(held) | reserved,
                    f"host {kind} pool: {len(allocated - set(held) - reserved)} leaked slots, "
                    f"{len((set(held) | reserved) - allocated)} held but free",
                )
            require(self._pinned == sum(1 for e in self.entries.values() if e.pins), "pinned-page count is stale")
            for key, e in self.entries.items():
                require(e.pins >= 0, f"host page {key[:12]} has negative pins")
                require(not expect_unpinned or e.pins == 0, f"host page {key[:12]} still pinned when idle")


def stored_prefix(host: HostCache, keys: Sequence[str], swa_lo: int) -> tuple[int, bool]:
    """(leading pages of `keys` whose KV is in L3: full, and SWA from swa_lo on; whether any
    page is still queued for L3). The L3 writer threads mark pages in_l3 when their write is
    acknowledged; the PD prefill waits on this before it hands a request over."""
    stored, counting, queued = 0, True, False
    for i, k in enumerate(keys):
        e = host.get(k)
        if e is None:
            counting = False
            continue
        queued = queued or e.l3_queued
        if counting and e.in_l3 and not e.l3_queued and (i < swa_lo or e.swa is not None):
            stored += 1
        else:
            counting = False
    return stored, queued
