"""GCache's L3 as vLLM 0.32 KV events: the bytes (docs/kv-events.md is the contract).

vLLM (distributed/kv_events.py) publishes an `EventBatch` per message, msgpack-encoded by
msgspec: the batch as an array [ts, [event, ...], data_parallel_rank], each event as a map
whose "type" key names it (tag_field "type"). These functions write the same shapes with
plain msgpack, so a vLLM-event consumer (llm-d's indexer, Dynamo's router, gcache-router)
reads them unchanged. Every field vLLM 0.32 defines is written, defaults included (a
consumer written for an older vLLM may look for any of them).

What marks them as GCache's shared store and not an engine's own memory: medium "GCACHE",
locality "REMOTE", ownership "gcache" (the secondary tier's id).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack

MEDIUM = "GCACHE"
LOCALITY = "REMOTE"
OWNERSHIP = "gcache"
KIND_FULL = "full_attention"
KIND_SWA = "sliding_window"

Event = dict[str, Any]  # one event, as a msgpack map
BlockHash = int | bytes  # what vLLM puts in events (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)


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
