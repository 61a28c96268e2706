"""vLLM's KV events turned into the router's page flags: what one engine holds, by page id.

The events' format (vLLM 0.32's, decoded and bounds-checked) is gcache.serving.announce.wire.

vLLM's block hashes are its own (sha256 over its own serialisation, seeded, truncated to 64
bits); the router names a page by GCache's chain (gcache.wire.keys: sha256(parent digest ||
tokens as u32 LE)). A BlockStored carries the token ids of its blocks and its parent's vLLM
hash, so the chain is recomputed here on arrival: `chain` maps a vLLM hash to our digest,
and a block's digest is sha256(parent's digest || its tokens). A block whose extra_keys are
set (an image, a LoRA, a cache salt) gets a digest no router computes from text (the block
and everything after it never match a text prompt: a router cannot see those keys). A
store whose parent this translator never saw (it started late, or the parent's entry aged
out of the bounded chain) cannot be named and is dropped (`orphans`).

Flags (gcache.serving.redis_layout): a page held by a full-attention group (full, MLA,
sink-full) is FULL, by every sliding-window (or Mamba) group SWA, in L1 for medium GPU (or
unset) and L2 for CPU; an engine without sliding-window groups marks every FULL page SWA as
well, its window is 1. The router's window-safe match (match.py, the bundled worker's rule)
then counts a prefix only up to a point whose window tail every sliding group still holds:
an evicted window is no hit. A Mamba group counts as a window of 1 (its state at the resume
point); several sliding groups: their largest window, and each must hold the page.
Groups of other kinds (chunked local, encoder, cross) are ignored (`ignored_groups`).

Never trusted: every field is type- and range-checked; a malformed event is dropped and
counted (`malformed`), a malformed batch too (`bad_batches`); sizes are bounded (bytes per
batch, events per batch, hashes per event, held blocks, chain entries, dirty pages). When
the held blocks exceed pages_max the oldest are dropped (a dropped block is no longer
credited: a bound can cost hits, never route to a page that is gone).

Shared-L3 mode (`shared_l3=True`, l3_events.py): the events of GCache's vLLM connectors
(medium "GCACHE", locality "REMOTE" or unset) instead of an engine's own, and the flags are the
shared L3 view's (L3_FULL / L3_SWA, same rules); every other medium is ignored. The
connectors' translations share one Chain: the L3 is one namespace, so a page engine B stores
on a prefix engine A announced is named from A's announcement (vLLM's block hashes agree
across engines: sha256 with its fixed default seed, or one PYTHONHASHSEED). B's store may
arrive first (independent sockets): it waits, bounded (Chain.park, ORPHAN_WAIT_S), and is an
orphan only if no event names its parent by then.

Sequence: a gap in the ZMQ sequence numbers (vLLM's PUB drops when a subscriber lags) or a
restart (the number goes back) means removals may have been missed: everything held is
cleared (`gaps`, `restarts`), as after AllBlocksCleared. What is cleared is relearned from
the next stores (vLLM also re-reports reused blocks when kv_cache_report_mode is "full").
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

from gcache.serving.announce.wire import (
    FULL_KINDS,
    LOCALITY,
    MAMBA_KINDS,
    MEDIUM,
    SWA_KINDS,
    Cleared,
    Malformed,
    Removed,
    Stored,
    WireLimits,
    decode_batch,
    decode_event,
    parse_frames,
)
from gcache.serving.redis_layout import L1_FULL, L1_SWA, L2_FULL, L2_SWA, L3_FULL, L3_SWA

TIER_OF_MEDIUM = {None: 1, "GPU": 1, "CPU": 2}  # L1, L2; anything else is not this engine's own memory
L3_TIER = 3  # GCache's connectors' L3 events (medium wire.MEDIUM): the shared L3
ORPHAN_WAIT_S = 2.0  # a parked store (Chain) waits this long for another connector to name its parent
EXTRA_DOMAIN = b"gcache-router:extra-keys\x00"  # digests of blocks with extra keys (never a text prompt's)

STATS = (
    "frames",
    "batches",
    "bad_batches",
    "bad_frames",
    "events",
    "stored_blocks",
    "removed_blocks",
    "cleared",
    "malformed",
    "orphans",
    "unresolved",
    "ignored_groups",
    "ignored_media",
    "other_block_size",
    "evicted",
    "gaps",
    "restarts",
    "dropped_dirty",
    "snapshots",
    "deltas",
)


@dataclass(frozen=True)
class Limits(WireLimits):
    """What one message may carry (WireLimits), and what the translation holds."""

    pages_max: int = 1 << 20  # (rank, group, tier, block) entries held; oldest dropped beyond
    chain_max: int = 1 << 21  # vLLM hash -> our digest entries (content, kept past removal)
    dirty_max: int = 1 << 16  # pages changed between two takes; beyond: the next take is a snapshot


@dataclass
class Batch:
    full: bool  # a snapshot (replace everything) or a delta
    pages: list  # (page id, flags); flags 0 = gone


@dataclass
class Group:
    kind: str
    window: int  # tokens (sliding); 1 for mamba; 0 for full


class Parked(NamedTuple):
    """A store whose parent no event named yet, waiting for another connector's to name it."""

    owner: EngineEvents
    rank: int
    ev: Stored
    since: float | None  # the caller's clock (None: never expires by time, only by the bound)
    withdrawn: set  # its hashes removed since (by its owner): not held when it is named


class Chain:
    """vLLM block hash -> GCache's 32-byte chain digest: content knowledge, a bounded LRU.

    One Chain may serve several EngineEvents (the L3 subscriber's connectors: the shared L3 is
    one namespace, and a page one engine stores may extend a prefix another announced); they
    then share its lock, which guards the chain and every sharer's state. Their streams are
    independent sockets, so B's store may arrive before A's announcement of its parent: with
    parked_max > 0 such a store waits (at most parked_max of them, for ORPHAN_WAIT_S) and is
    held once another event names its parent; one that waits out is counted an orphan."""

    def __init__(self, entries_max: int, parked_max: int = 0) -> None:
        self.entries_max = entries_max
        self.lock = threading.Lock()
        self.digests: OrderedDict = OrderedDict()
        self.parked_max = parked_max
        self.parked: deque[Parked] = deque()

    def get(self, h) -> bytes | None:
        return self.digests.get(h)

    def __contains__(self, h) -> bool:
        return h in self.digests

    def __len__(self) -> int:
        return len(self.digests)

    def put(self, h, digest: bytes) -> None:
        self.digests[h] = digest
        self.digests.move_to_end(h)
        while len(self.digests) > self.entries_max:
            self.digests.popitem(last=False)

    # ---- parked stores (caller holds the lock) -------------------------------------------
    def park(self, owner: EngineEvents, rank: int, ev: Stored, now: float | None) -> bool:
        """Keep an orphan store for later; False when this chain does not park."""
        if not self.parked_max:
            return False
        self.parked.append(Parked(owner, rank, ev, now, set()))
        while len(self.parked) > self.parked_max:
            self._give_up(self.parked.popleft())
        return True

    def settle(self, now: float | None) -> None:
        """Hold the parked stores whose parent is now named (a named one may name the next:
        repeat while any is); count those that waited out ORPHAN_WAIT_S as orphans."""
        progress = True
        while progress and self.parked:
            progress = False
            waiting: deque[Parked] = deque()
            for p in self.parked:
                if p.ev.parent in self.digests:
                    p.owner._learn(p.ev)
                    p.owner._store(p.rank, p.ev, skip=p.withdrawn)
                    progress = True
                elif now is not None and p.since is not None and now - p.since > ORPHAN_WAIT_S:
                    self._give_up(p)
                else:
                    waiting.append(p)
            self.parked = waiting

    def withdraw(self, owner: EngineEvents, rank: int, group: int, hashes: list) -> None:
        """owner removed these blocks: a parked store of them must not hold them later."""
        for p in self.parked:
            if p.owner is owner and p.rank == rank and p.ev.group == group:
                p.withdrawn.update(h for h in hashes if h in p.ev.hashes)

    def unpark(self, owner: EngineEvents, rank: int | None = None) -> None:
        """owner's state (or one rank's) was cleared: its parked stores go with it."""
        self.parked = deque(p for p in self.parked if p.owner is not owner or (rank is not None and p.rank != rank))

    @staticmethod
    def _give_up(p: Parked) -> None:
        p.owner.stats["orphans"] += len(p.ev.hashes)


class EngineEvents:
    """One engine's KV events -> page flags, with take() / failed() for a publisher.

    Thread-safe: apply_* (the subscriber thread) and take / failed / clear (the publisher
    thread) take one lock; each holds it for one batch at most."""

    def __init__(self, limits: Limits | None = None, shared_l3: bool = False, chain: Chain | None = None) -> None:
        self.limits = limits or Limits()
        self.shared_l3 = shared_l3
        self.chain = chain if chain is not None else Chain(self.limits.chain_max)  # vLLM hash -> our digest
        self.lock = self.chain.lock
        self.held: OrderedDict = OrderedDict()  # (rank, group, tier, vLLM hash) -> page id
        self.holders: dict[int, dict] = {}  # page id -> {(tier, group): count}
        self.groups: dict[int, Group] = {}
        self.page_size: int | None = None  # block size of the full-attention groups (first seen)
        self.dirty: dict[int, None] = {}
        self.resync = True  # the first take is a snapshot
        self.last_seq: dict[bytes, int] = {}  # per topic
        self.last_event_at: float | None = None  # caller's clock, set by apply_frame
        self._now: float | None = None  # the batch being applied: its caller's clock
        self.stats = dict.fromkeys(STATS, 0)

    # ---- what the router needs to know ------------------------------------------------------
    @property
    def window(self) -> int:
        """The registration's window (tokens): the largest sliding window; 1 without any."""
        return max([g.window for g in self.groups.values() if g.kind not in FULL_KINDS] or [1])

    def flags_of(self, pid: int) -> int:
        """Caller holds the lock."""
        h = self.holders.get(pid)
        if not h:
            return 0
        sliding = [g for g, grp in self.groups.items() if grp.kind not in FULL_KINDS]
        out = 0
        tiers = ((L3_TIER, L3_FULL, L3_SWA),) if self.shared_l3 else ((1, L1_FULL, L1_SWA), (2, L2_FULL, L2_SWA))
        for tier, full_bit, swa_bit in tiers:
            full = any(t == tier and self.groups.get(g, Group("full_attention", 0)).kind in FULL_KINDS for t, g in h)
            if not full:
                continue
            out |= full_bit
            if all((tier, g) in h for g in sliding):  # no sliding group: every full page is window-safe
                out |= swa_bit
        return out

    # ---- input -----------------------------------------------------------------------------
    def apply_frame(self, frames, now: float | None = None) -> None:
        """One ZMQ multipart message (topic, seq, payload). Never raises."""
        self.stats["frames"] += 1
        try:
            topic, seq, payload = parse_frames(frames)
        except Malformed:
            self.stats["bad_frames"] += 1
            return
        with self.lock:
            last = self.last_seq.get(topic)
            if last is not None and seq != last + 1:
                self.stats["restarts" if seq <= last else "gaps"] += 1
                self._clear_locked()  # removals may have been missed: credit nothing we cannot vouch for
            self.last_seq[topic] = seq
            if now is not None:
                self.last_event_at = now
        self.apply_batch(payload, now)

    def apply_batch(self, payload: bytes, now: float | None = None) -> None:
        """One msgpack EventBatch. Never raises."""
        try:
            events, rank = decode_batch(payload, self.limits)
        except Malformed:
            self.stats["bad_batches"] += 1
            return
        self.stats["batches"] += 1
        parsed = []
        for raw in events:
            self.stats["events"] += 1
            try:
                parsed.append(decode_event(raw, self.limits))
            except (Malformed, TypeError, ValueError, OverflowError):
                self.stats["malformed"] += 1
        with self.lock:
            self._now = now  # when a store parked in pass 2 started waiting
            # Pass 1: learn every digest this batch can name (content knowledge only), so that a
            # sliding group's store, which may skip blocks, finds the full group's names.
            for ev in parsed:
                if isinstance(ev, Stored):
                    self._learn(ev)
            # Pass 2: what is held, in order.
            for ev in parsed:
                if isinstance(ev, Stored):
                    self._store(rank, ev)
                elif isinstance(ev, Removed):
                    self._remove(rank, ev)
                elif isinstance(ev, Cleared):
                    self.stats["cleared"] += 1
                    self._clear_locked(rank)
            self.chain.settle(now)  # stores parked for a parent this batch may have named

    # ---- state (caller holds the lock) ----------------------------------------------------------
    def _learn(self, ev: Stored) -> None:
        """Digests of a store whose token ids cover exactly its blocks (no skipped ones)."""
        hashes, bs = ev.hashes, ev.block_size
        if ev.n_blocks != len(hashes):
            return  # a sliding group skipped blocks: its hashes are named by pass 1's others
        known = b"" if ev.parent is None else self.chain.get(ev.parent)
        if known is None:
            return
        prior: bytes = known
        tokens, step = ev.tokens, 4 * bs
        for i, h in enumerate(hashes):
            raw = tokens[i * step : (i + 1) * step]
            if ev.extra[i] or ev.lora:
                d = hashlib.sha256(EXTRA_DOMAIN + prior + raw).digest()
            else:
                d = hashlib.sha256(prior + raw).digest()
            self.chain.put(h, d)
            prior = d

    def _group(self, ev: Stored) -> Group | None:
        g = self.groups.get(ev.group)
        kind, window = ev.kind, ev.window
        if kind in FULL_KINDS:
            window = 0
        elif kind in MAMBA_KINDS:
            window = 1
        elif kind not in SWA_KINDS:
            return None
        if g is None or g.kind != kind or g.window != window:
            if len(self.groups) >= self.limits.groups_max and g is None:
                return None
            self.groups[ev.group] = g = Group(kind, window)
            self.resync = True  # every page's flags may change (a new sliding group)
            self.dirty.clear()
        return g

    def _tier(self, ev: Stored | Removed) -> int | None:
        """The tier an event's blocks are in, or None when this translator does not track it."""
        if self.shared_l3:
            return L3_TIER if ev.medium == MEDIUM and ev.locality in (None, LOCALITY) else None
        return TIER_OF_MEDIUM.get(ev.medium) if ev.locality in (None, "LOCAL") else None

    def _store(self, rank: int, ev: Stored, skip: set | frozenset = frozenset()) -> None:
        tier = self._tier(ev)
        if tier is None:
            self.stats["ignored_media"] += 1
            return
        g = self._group(ev)
        if g is None:
            self.stats["ignored_groups"] += 1
            return
        if g.kind in FULL_KINDS:
            if self.page_size is None:
                self.page_size = ev.block_size
        if ev.block_size != (self.page_size or ev.block_size):
            self.stats["other_block_size"] += 1  # a partial block, or a group of another size
            return
        orphan = ev.parent is not None and ev.parent not in self.chain
        if orphan and self.chain.park(self, rank, ev, self._now):
            return  # another connector's event may name its parent (Chain.settle)
        for h in ev.hashes:
            if h in skip:
                continue
            d = self.chain.get(h)
            if d is None:  # never named: its parent was never seen, or a skipped-block store's
                self.stats["orphans" if orphan else "unresolved"] += 1
                continue
            self._hold((rank, ev.group, tier, h), int.from_bytes(d[:8], "big"))
            self.stats["stored_blocks"] += 1

    def _hold(self, key: tuple, pid: int) -> None:
        old = self.held.get(key)
        if old is not None:
            self.held.move_to_end(key)
            if old == pid:
                return
            self._release(key, old)
        self.held[key] = pid
        h = self.holders.setdefault(pid, {})
        tg = (key[2], key[1])
        h[tg] = h.get(tg, 0) + 1
        self._touch(pid)
        while len(self.held) > self.limits.pages_max:
            k, p = self.held.popitem(last=False)
            self._release(k, p)
            self.stats["evicted"] += 1

    def _release(self, key: tuple, pid: int) -> None:
        h = self.holders.get(pid)
        if h is None:
            return
        tg = (key[2], key[1])
        n = h.get(tg, 0) - 1
        if n > 0:
            h[tg] = n
        else:
            h.pop(tg, None)
            if not h:
                del self.holders[pid]
        self._touch(pid)

    def _remove(self, rank: int, ev: Removed) -> None:
        tier = self._tier(ev)
        if tier is None:
            self.stats["ignored_media"] += 1
            return
        if self.chain.parked:
            self.chain.withdraw(self, rank, ev.group, ev.hashes)
        for h in ev.hashes:
            key = (rank, ev.group, tier, h)
            pid = self.held.pop(key, None)
            if pid is not None:
                self._release(key, pid)
                self.stats["removed_blocks"] += 1

    def _touch(self, pid: int) -> None:
        if self.resync or pid in self.dirty:
            return
        if len(self.dirty) >= self.limits.dirty_max:
            self.stats["dropped_dirty"] += 1
            self.resync = True
            self.dirty.clear()
            return
        self.dirty[pid] = None

    def _clear_locked(self, rank: int | None = None) -> None:
        if self.chain.parked:
            self.chain.unpark(self, rank)
        if rank is None:
            self.held.clear()
            self.holders.clear()
            self.resync = True
            self.dirty.clear()
            return
        for key in [k for k in self.held if k[0] == rank]:
            self._release(key, self.held.pop(key))

    # ---- the publisher's side -------------------------------------------------------------------
    def clear(self) -> None:
        """Forget what the engine holds (its events stopped, or it restarted)."""
        with self.lock:
            self._clear_locked()

    def take(self) -> Batch:
        with self.lock:
            if self.resync:
                self.resync = False
                self.dirty.clear()
                self.stats["snapshots"] += 1
                pages = [(pid, f) for pid in self.holders if (f := self.flags_of(pid))]
                return Batch(True, pages)
            pages = [(pid, self.flags_of(pid)) for pid in self.dirty]
            self.dirty.clear()
            if pages:
                self.stats["deltas"] += 1
            return Batch(False, pages)

    def failed(self, batch: Batch | None) -> None:
        """A taken batch did not reach Redis: the next take is a snapshot."""
        with self.lock:
            self.resync = True
            self.dirty.clear()

    def pages(self) -> int:
        with self.lock:
            return len(self.holders)
