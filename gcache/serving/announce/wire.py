"""KV events on the wire, both ways: vLLM 0.32's format, one definition (docs/kv-events.md).

vLLM (distributed/kv_events.py) publishes on ZMQ a multipart message per batch: (topic,
8-byte big-endian sequence number, msgpack `EventBatch`), the batch an array [ts, [event,
...], data_parallel_rank], each event a map whose "type" key names it (tag_field "type");
older vLLM and SGLang write an event as an array, the tag first (both are read):

  BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                    lora_name, extra_keys, group_idx, kv_cache_spec_kind,
                    kv_cache_spec_sliding_window, locality, ownership, session_id
  BlockRemoved      block_hashes, medium, group_idx, locality, ownership
  AllBlocksCleared  (nothing)

Encoding (GCache's vLLM connector announcing its L3): every field vLLM 0.32 defines is
written, defaults included (a consumer written for an older vLLM may look for any of them),
with plain msgpack, so a vLLM-event consumer (llm-d's indexer, Dynamo's router,
gcache-router) reads them unchanged. What marks them as GCache's shared store and not an
engine's own memory: medium "GCACHE", locality "REMOTE", ownership "gcache".

Decoding (the router's ingest, of an engine's own events and of the L3 ones): never trusted.
Every field is type- and range-checked and sizes are bounded (WireLimits); what is not what
vLLM publishes raises Malformed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

MEDIUM = "GCACHE"  # GCache's shared L3
LOCALITY = "REMOTE"
OWNERSHIP = "gcache"
KIND_FULL = "full_attention"
KIND_SWA = "sliding_window"
FULL_KINDS = frozenset({KIND_FULL, "mla_attention", "sink_full_attention"})
SWA_KINDS = frozenset({KIND_SWA, "sliding_window_mla"})
MAMBA_KINDS = frozenset({"mamba"})

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

Event = dict[str, Any]  # one event, as a msgpack map
BlockHash = int | bytes  # what vLLM puts in events (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)


# ---- encode -----------------------------------------------------------------------------------
class StoredRun(NamedTuple):
    """Consecutive pages of one KV cache group, each confirmed in the store."""

    group_idx: int
    kind: str  # KIND_FULL or KIND_SWA
    window: int | None  # sliding window (tokens) of a KIND_SWA group
    block_size: int
    parent_block_hash: BlockHash | None  # the page before the first (None: the prompt's first page)
    block_hashes: Sequence[BlockHash]
    token_ids: Sequence[int]  # block_size per page, in order


def block_stored(run: StoredRun) -> Event:
    return {
        "type": "BlockStored",
        "block_hashes": list(run.block_hashes),
        "parent_block_hash": run.parent_block_hash,
        "token_ids": list(run.token_ids),
        "block_size": run.block_size,
        "lora_id": None,
        "medium": MEDIUM,
        "lora_name": None,
        "extra_keys": None,
        "group_idx": run.group_idx,
        "kv_cache_spec_kind": run.kind,
        "kv_cache_spec_sliding_window": run.window,
        "locality": LOCALITY,
        "ownership": OWNERSHIP,
        "session_id": None,
    }


def block_removed(group_idx: int, block_hashes: Sequence[BlockHash]) -> Event:
    return {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": MEDIUM,
        "group_idx": group_idx,
        "locality": LOCALITY,
        "ownership": OWNERSHIP,
    }


def event_batch(ts: float, events: Sequence[Event], data_parallel_rank: int | None = None) -> bytes:
    """One EventBatch, as vLLM's msgspec encoder writes it (an array)."""
    out: bytes = msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)
    return out


def frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One ZMQ multipart message: topic, sequence number, EventBatch."""
    return [topic, seq.to_bytes(8, "big"), payload]


# ---- decode -----------------------------------------------------------------------------------
class Malformed(ValueError):
    """An event, batch or message that is not what vLLM publishes."""


@dataclass(frozen=True)
class WireLimits:
    """Bounds on what one message may carry."""

    batch_bytes_max: int = 64 << 20  # one msgpack EventBatch
    events_per_batch_max: int = 1 << 16
    hashes_per_event_max: int = 1 << 14
    block_size_max: int = 1 << 14
    groups_max: int = 64
    ranks_max: int = 1024

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not 1 <= getattr(self, name) <= 1 << 30:
                raise ValueError(f"{name} must be in [1, 2^30]")


class Stored(NamedTuple):
    hashes: list[BlockHash]
    parent: BlockHash | None
    tokens: bytes  # the token ids, u32 little-endian (gcache.wire.keys' chain input)
    n_blocks: int  # whole blocks the token ids cover (a sliding group may skip blocks)
    block_size: int
    extra: list[bool]  # per block: extra keys set (an image, a cache salt)
    lora: bool
    medium: str | None
    locality: str | None
    group: int
    kind: str
    window: int  # sliding window in tokens (0 when not given)


class Removed(NamedTuple):
    hashes: list[BlockHash]
    medium: str | None
    group: int
    locality: str | None


class Cleared(NamedTuple):
    pass


DecodedEvent = Stored | Removed | Cleared


def parse_frames(msg: Any) -> tuple[bytes, int, bytes]:
    """(topic, sequence number, payload) of one multipart message; Malformed if it is none
    (including vLLM's replay end marker, a negative sequence, never on the PUB stream)."""
    if not isinstance(msg, (list, tuple)) or len(msg) != 3:
        raise Malformed("a KV-event message is (topic, seq, payload)")
    topic, seq_raw, payload = (bytes(f) for f in msg)
    if len(seq_raw) != 8 or len(topic) > 4096:
        raise Malformed("bad sequence number or topic")
    seq = int.from_bytes(seq_raw, "big", signed=True)
    if seq < 0:
        raise Malformed("negative sequence number")
    return topic, seq, payload


def decode_batch(payload: bytes, limits: WireLimits) -> tuple[list[Any], int]:
    """(raw events, data-parallel rank) of one msgpack EventBatch; Malformed if it is none."""
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


def decode_event(raw: Any, limits: WireLimits) -> DecodedEvent:
    """One event of a batch; Malformed (or TypeError, ValueError, OverflowError for odd values)
    if it is not what vLLM publishes."""
    tag = _tag(raw)
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag == "BlockRemoved":
        f = _fields(raw, REMOVED_FIELDS)
        hashes = f["block_hashes"]
        if not isinstance(hashes, list) or len(hashes) > limits.hashes_per_event_max:
            raise Malformed("block_hashes must be a bounded list")
        return Removed(
            [_hash_key(h) for h in hashes],
            _opt_str(f["medium"], "medium"),
            _opt_int(f["group_idx"], 0, limits.groups_max - 1, "group_idx") or 0,
            _opt_str(f["locality"], "locality"),
        )
    if tag != "BlockStored":
        raise Malformed(f"unknown event type {tag[:40]!r}")
    f = _fields(raw, STORED_FIELDS)
    hashes, tokens = f["block_hashes"], f["token_ids"]
    if not isinstance(hashes, list) or not 0 < len(hashes) <= limits.hashes_per_event_max:
        raise Malformed("block_hashes must be a non-empty bounded list")
    bs = _opt_int(f["block_size"], 1, limits.block_size_max, "block_size")
    if bs is None:
        raise Malformed("block_size missing")
    if not isinstance(tokens, list) or len(tokens) % bs or len(tokens) < bs * len(hashes):
        raise Malformed("token_ids must cover whole blocks, at least one per hash")
    if len(tokens) > bs * limits.hashes_per_event_max:
        raise Malformed("too many token ids")
    try:
        token_bytes = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        raise Malformed("token ids must be ints in [0, 2^32)") from None
    extra = f["extra_keys"]
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise Malformed("extra_keys must have one entry per block hash")
    kind = _opt_str(f["kv_cache_spec_kind"], "kv_cache_spec_kind", 64) or KIND_FULL
    window = _opt_int(f["kv_cache_spec_sliding_window"], 1, 1 << 30, "kv_cache_spec_sliding_window")
    if kind in SWA_KINDS and window is None:
        raise Malformed("a sliding-window block without its window")
    parent = f["parent_block_hash"]
    return Stored(
        hashes=[_hash_key(h) for h in hashes],
        parent=None if parent is None else _hash_key(parent),
        tokens=token_bytes,
        n_blocks=len(tokens) // bs,
        block_size=bs,
        extra=[e is not None and e != [] for e in extra] if extra is not None else [False] * len(hashes),
        lora=f["lora_name"] is not None or f["lora_id"] is not None,
        medium=_opt_str(f["medium"], "medium"),
        locality=_opt_str(f["locality"], "locality"),
        group=_opt_int(f["group_idx"], 0, limits.groups_max - 1, "group_idx") or 0,
        kind=kind,
        window=window or 0,
    )


def _hash_key(h: Any) -> BlockHash:
    """A vLLM block hash as a dict key: an int in [0, 2^64) or bytes (at most 64)."""
    if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64:
        return h
    if isinstance(h, bytes) and 0 < len(h) <= 64:
        return h
    raise Malformed("block hash must be an int in [0, 2^64) or bytes")


def _opt_int(v: Any, lo: int, hi: int, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise Malformed(f"{what} must be an int in [{lo}, {hi}]")
    return v


def _opt_str(v: Any, what: str, n: int = 256) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > n:
        raise Malformed(f"{what} must be a short string")
    return v


def _fields(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """An event's fields from its map form (tag under "type") or array form (tag first)."""
    if isinstance(raw, dict):
        return {k: raw.get(k) for k in names}
    if isinstance(raw, (list, tuple)):
        vals = list(raw[1:])
        if len(vals) > len(names):
            raise Malformed("event has more fields than its type")
        return dict(zip(names, vals + [None] * (len(names) - len(vals))))
    raise Malformed("event must be a map or an array")


def _tag(raw: Any) -> str:
    if isinstance(raw, dict):
        t = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        t = raw[0]
    else:
        t = None
    if not isinstance(t, str):
        raise Malformed("event has no type tag")
    return t
