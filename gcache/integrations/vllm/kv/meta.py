"""What the scheduler side tells the worker side each step, and what the workers tell the
scheduler once at start (vLLM pickles both across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

if TYPE_CHECKING:
    from gcache.integrations.vllm.kv.keys import GroupTag


class PageRef(NamedTuple):
    group: int  # the KV cache group's index
    page_hash: str
    block_id: int  # the vLLM block the page lives in (or is loaded into)
    tokens: int = 0  # a save's: the prefix length at the page's end (what a state spares)


class LoadSpec(NamedTuple):
    req_id: str
    pages: tuple[PageRef, ...]
    asynchronous: bool  # loaded between steps (the request waits in WAITING_FOR_REMOTE_KVS)
    staged: tuple[int, ...] = ()  # per page, its prefetch staging slot (link.WorkerLink); () none


class SaveSpec(NamedTuple):
    req_id: str
    pages: tuple[PageRef, ...]  # computed by this step's forward


@dataclass
class GCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()
    idle: bool = False  # the step runs no forward: the worker may wait briefly for a load in flight
    # A step with a forward: how long the worker may wait at its end for a load in flight, so
    # the load is reported in this step rather than the next (0: do not wait).
    load_wait_s: float = 0.0


@dataclass
class GCacheHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once its KV is registered: each group's key tag
    (keys.GroupTag), which only the worker can know (layout, kernel block size, segments)."""

    tags: dict[int, GroupTag] = field(default_factory=dict)  # group index -> GroupTag
    value_bytes: dict[int, int] = field(default_factory=dict)  # group index -> one value's bytes
