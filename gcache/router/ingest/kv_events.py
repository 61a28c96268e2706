"""vLLM's KV events turned into the router's page flags: what one engine holds, by page id.

vLLM (`--kv-events-config`, distributed/kv_events.py) publishes on ZMQ a multipart message
per scheduler step: (topic, 8-byte big-endian sequence number, msgpack `EventBatch`), an
EventBatch being [ts, [event, ...], data_parallel_rank]. Events (vLLM 0.32 encodes each as
a map tagged by "type"; older vLLM and SGLang as an array, the tag first; both are read):

  BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                    lora_name, extra_keys, group_idx, kv_cache_spec_kind,
                    kv_cache_spec_sliding_window, locality, ownership, session_id
  BlockRemoved      block_hashes, medium, group_idx, locality, ownership
  AllBlocksCleared  (nothing)

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
shared L3 view's (L3_FULL / L3_SWA, same rules); every other medium is ignored.

Sequence: a gap in the ZMQ sequence numbers (vLLM's PUB drops when a subscriber lags) or a
restart (the number goes back) means removals may have been missed: everything held is
cleared (`gaps`, `restarts`), as after AllBlocksCleared. What is cleared is relearned from
the next stores (vLLM also re-reports reused blocks when kv_cache_report_mode is "full").
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import msgpack

from gcache.serving.redis_layout import L1_FULL, L1_SWA, L2_FULL, L2_SWA, L3_FULL, L3_SWA

FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
SWA_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA_KINDS = frozenset({"mamba"})
TIER_OF_MEDIUM = {None: 1, "GPU": 1, "CPU": 2}  # L1, L2; anything else is not this engine's own memory
L3_MEDIUM, L3_TIER = "GCACHE", 3  # GCache's connectors' L3 events (docs/kv-events.md): the shared L3
EXTRA_DOMAIN = b"gcache-router:extra-keys\x00"  # digests of blocks with extra keys (never a text prompt's)

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
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


class Malformed(ValueError):
    """An event (or batch) that is not what vLLM publishes."""


@dataclass(frozen=True)
class Limits:
    batch_bytes_max: int = 64 << 20  # one msgpack EventBatch
    events_per_batch_max: int = 1 << 16
    hashes_per_event_max: int = 1 << 14
    block_size_max: int = 1 << 14
    groups_max: int = 64
    ranks_max: int = 1024
    pages_max: int = 1 << 20  # (rank, group, tier, block) entries held; oldest dropped beyond
    chain_max: int = 1 << 21  # vLLM hash -> our digest entries (content, kept past removal)
    dirty_max: int = 1 << 16  # pages changed between two takes; beyond: the next take is a snapshot

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not 1 <= getattr(self, name) <= 1 << 30:
                raise ValueError(f"{name} must be in [1, 2^30]")


@dataclass
class Batch:
    full: bool  # a snapshot (replace everything) or a delta
    pages: list  # (page id, flags); flags 0 = gone


@dataclass
class Group:
    kind: str
    window: int  # tokens (sliding); 1 for mamba; 0 for full


def _hash_key(h):
    """A vLLM block hash as a dict key: an int in [0, 2^64) or bytes (at most 64)."""
    if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64:
        return h
    if isinstance(h, bytes) and 0 < len(h) <= 64:
        return h
    raise Malformed("block hash must be an int in [0, 2^64) or bytes")


def _opt_int(v, lo: int, hi: int, what: str):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise Malformed(f"{what} must be an int in [{lo}, {hi}]")
    return v


def _opt_str(v, what: str, n: int = 256):
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > n:
        raise Malformed(f"{what} must be a short string")
    return v


def _fields(raw, names: tuple[str, ...]) -> dict:
    """An event's fields from its map form (tag under "type") or array form (tag first)."""
    if isinstance(raw, dict):
        return {k: raw.get(k) for k in names}
    if isinstance(raw, (list, tuple)):
        vals = list(raw[1:])
        if len(vals) > len(names):
            raise Malformed("event has more fields than its type")
        return dict(zip(names, vals + [None] * (len(names) - len(vals))))
    raise Malformed("event must be a map or an array")


def _tag(raw) -> str:
    if isinstance(raw, dict):
        t = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        t = raw[0]
    else:
        t = None
    if not isinstance(t, str):
        raise Malformed("event has no type tag")
    return t


def decode_batch(payload: bytes, limits: Limits) -> tuple[list, int]:
    """(events, data-parallel rank) of one msgpack EventBatch; Malformed if it is none."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or len(payload) > limits.batch_bytes_max:
        raise Malformed("batch too large")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)  # limits: len(payload)
    except Exception as e:  # noqa: BLE001 - msgpack raises many kinds for hostile input
        raise Malformed(f"not msgpack: {type(e).__name__}") from None
    if isinstance(obj, dict):  # a map-encoded EventBatch (not vLLM's, but cheap to accept)
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, list) or not 2 <= len(obj) <= 3 or not isinstance(obj[1], list):
        raise Malformed("an EventBatch is [ts, [events], dp_rank]")
    if len(obj[1]) > limits.events_per_batch_max:
        raise Malformed("too many events in one batch")
    rank = _opt_int(obj[2] if len(obj) == 3 else None, 0, limits.ranks_max - 1, "data_parallel_rank") or 0
    return obj[1], rank


class EngineEvents:
    """One engine's KV events -> page flags, with take() / failed() for a publisher.

    Thread-safe: apply_* (the subscriber thread) and take / failed / clear (the publisher
    thread) take one lock; each holds it for one batch at most."""

    def __init__(self, limits: Limits | None = None, shared_l3: bool = False) -> None:
        self.limits = limits or Limits()
        self.shared_l3 = shared_l3
        self.lock = threading.Lock()
        self.chain: OrderedDict = OrderedDict()  # vLLM hash -> our 32-byte digest
        self.held: OrderedDict = OrderedDict()  # (rank, group, tier, vLLM hash) -> page id
        self.holders: dict[int, dict] = {}  # page id -> {(tier, group): count}
        self.groups: dict[int, Group] = {}
        self.page_size: int | None = None  # block size of the full-attention groups (first seen)
        self.dirty: dict[int, None] = {}
        self.resync = True  # the first take is a snapshot
        self.last_seq: dict[bytes, int] = {}  # per topic
        self.last_event_at: float | None = None  # caller's clock, set by apply_frame
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
        if not isinstance(frames, (list, tuple)) or len(frames) != 3:
            self.stats["bad_frames"] += 1
            return
        topic, seq_raw, payload = (bytes(f) for f in frames)
        if len(seq_raw) != 8 or len(topic) > 4096:
            self.stats["bad_frames"] += 1
            return
        seq = int.from_bytes(seq_raw, "big", signed=True)
        if seq < 0:
            self.stats["bad_frames"] += 1  # vLLM's replay end marker, never on the PUB stream
            return
        with self.lock:
            last = self.last_seq.get(topic)
            if last is not None and seq != last + 1:
                self.stats["restarts" if seq <= last else "gaps"] += 1
                self._clear_locked()  # removals may have been missed: credit nothing we cannot vouch for
            self.last_seq[topic] = seq
            if now is not None:
                self.last_event_at = now
        self.apply_batch(payload)

    def apply_batch(self, payload: bytes) -> None:
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
                parsed.append(self._parse(raw))
            except (Malformed, TypeError, ValueError, OverflowError):
                self.stats["malformed"] += 1
        with self.lock:
            # Pass 1: learn every digest this batch can name (content knowledge only), so that a
            # sliding group's store, which may skip blocks, finds the full group's names.
            for ev in parsed:
                if ev[0] == "stored":
                    self._learn(ev[1])
            # Pass 2: what is held, in order.
            for ev in parsed:
                if ev[0] == "stored":
                    self._store(rank, ev[1])
                elif ev[0] == "removed":
                    self._remove(rank, ev[1])
                elif ev[0] == "cleared":
                    self.stats["cleared"] += 1
                    self._clear_locked(rank)

    def _parse(self, raw) -> tuple:
        tag = _tag(raw)
        lim = self.limits
        if tag == "AllBlocksCleared":
            return ("cleared",)
        if tag == "BlockRemoved":
            f = _fields(raw, REMOVED_FIELDS)
            hashes = f["block_hashes"]
            if not isinstance(hashes, list) or len(hashes) > lim.hashes_per_event_max:
                raise Malformed("block_hashes must be a bounded list")
            return (
                "removed",
                dict(
                    hashes=[_hash_key(h) for h in hashes],
                    medium=_opt_str(f["medium"], "medium"),
                    group=_opt_int(f["group_idx"], 0, lim.groups_max - 1, "group_idx") or 0,
                    locality=_opt_str(f["locality"], "locality"),
                ),
            )
        if tag != "BlockStored":
            raise Malformed(f"unknown event type {tag[:40]!r}")
        f = _fields(raw, STORED_FIELDS)
        hashes, tokens = f["block_hashes"], f["token_ids"]
        if not isinstance(hashes, list) or not 0 < len(hashes) <= lim.hashes_per_event_max:
            raise Malformed("block_hashes must be a non-empty bounded list")
        bs = _opt_int(f["block_size"], 1, lim.block_size_max, "block_size")
        if bs is None:
            raise Malformed("block_size missing")
        if not isinstance(tokens, list) or len(tokens) % bs or len(tokens) < bs * len(hashes):
            raise Malformed("token_ids must cover whole blocks, at least one per hash")
        if len(tokens) > bs * lim.hashes_per_event_max:
            raise Malformed("too many token ids")
        try:
            token_bytes = struct.pack(f"<{len(tokens)}I", *tokens)
        except struct.error:
            raise Malformed("token ids must be ints in [0, 2^32)") from None
        extra = f["extra_keys"]
        if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
            raise Malformed("extra_keys must have one entry per block hash")
        kind = _opt_str(f["kv_cache_spec_kind"], "kv_cache_spec_kind", 64) or "full_attention"
        window = _opt_int(f["kv_cache_spec_sliding_window"], 1, 1 << 30, "kv_cache_spec_sliding_window")
        if kind in SWA_KINDS and window is None:
            raise Malformed("a sliding-window block without its window")
        parent = f["parent_block_hash"]
        return (
            "stored",
            dict(
                hashes=[_hash_key(h) for h in hashes],
                parent=None if parent is None else _hash_key(parent),
                tokens=token_bytes,
                n_blocks=len(tokens) // bs,
                block_size=bs,
                extra=[e is not None and e != [] for e in extra] if extra is not None else [False] * len(hashes),
                lora=f["lora_name"] is not None or f["lora_id"] is not None,
                medium=_opt_str(f["medium"], "medium"),
                locality=_opt_str(f["locality"], "locality"),
                group=_opt_int(f["group_idx"], 0, lim.groups_max - 1, "group_idx") or 0,
                kind=kind,
                window=window or 0,
            ),
        )

    # ---- state (caller holds the lock) ----------------------------------------------------------
    def _chain_put(self, h, digest: bytes) -> None:
        self.chain[h] = digest
        self.chain.move_to_end(h)
        while len(self.chain) > self.limits.chain_max:
            self.chain.popitem(last=False)

    def _learn(self, ev: dict) -> None:
        """Digests of a store whose token ids cover exactly its blocks (no skipped ones)."""
        hashes, bs = ev["hashes"], ev["block_size"]
        if ev["n_blocks"] != len(hashes):
            return  # a sliding group skipped blocks: its hashes are named by pass 1's others
        known = b"" if ev["parent"] is None else self.chain.get(ev["parent"])
        if known is None:
            return
        prior: bytes = known
        tokens, step = ev["tokens"], 4 * bs
        for i, h in enumerate(hashes):
            raw = tokens[i * step : (i + 1) * step]
            if ev["extra"][i] or ev["lora"]:
                d = hashlib.sha256(EXTRA_DOMAIN + prior + raw).digest()
            else:
                d = hashlib.sha256(prior + raw).digest()
            self._chain_put(h, d)
            prior = d

    def _group(self, ev: dict) -> Group | None:
        g = self.groups.get(ev["group"])
        kind, window = ev["kind"], ev["window"]
        if kind in FULL_KINDS:
            window = 0
        elif kind in MAMBA_KINDS:
            window = 1
        elif kind not in SWA_KINDS:
            return None
        if g is None or g.kind != kind or g.window != window:
            if len(self.groups) >= self.limits.groups_max and g is None:
                return None
            self.groups[ev["group"]] = g = Group(kind, window)
            self.resync = True  # every page's flags may change (a new sliding group)
            self.dirty.clear()
        return g

    def _tier(self, ev: dict) -> int | None:
        """The tier an event's blocks are in, or None when this translator does not track it."""
        if self.shared_l3:
            return L3_TIER if ev["medium"] == L3_MEDIUM and ev["locality"] in (None, "REMOTE") else None
        return TIER_OF_MEDIUM.get(ev["medium"]) if ev["locality"] in (None, "LOCAL") else None

    def _store(self, rank: int, ev: dict) -> None:
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
                self.page_size = ev["block_size"]
        if ev["block_size"] != (self.page_size or ev["block_size"]):
            self.stats["other_block_size"] += 1  # a partial block, or a group of another size
            return
        orphan = ev["parent"] is not None and ev["parent"] not in self.chain
        for h in ev["hashes"]:
            d = self.chain.get(h)
            if d is None:  # never named: its parent was never seen, or a skipped-block store's
                self.stats["orphans" if orphan else "unresolved"] += 1
                continue
            self._hold((rank, ev["group"], tier, h), int.from_bytes(d[:8], "big"))
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

    def _remove(self, rank: int, ev: dict) -> None:
        tier = self._tier(ev)
        if tier is None:
            self.stats["ignored_media"] += 1
            return
        for h in ev["hashes"]:
            key = (rank, ev["group"], tier, h)
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
