"""Prefetch: a request's stored prefix read into staging memory when the request arrives
(vLLM's on_new_request), so its bytes are staged before the scheduler first asks.

Without it the scheduler's first ask (get_num_new_matched_tokens) is a store round trip that
holds every running request up, and a load between steps is picked up one or two steps after
its bytes land. With it the read runs on a thread of its own while the engine steps; the
scheduler answers "not yet" (None) while it runs, and once the prefix is staged it plans a
load that is only a copy from staging into vLLM's blocks: no store call in the step, and no
worker report to wait for.

The read is also the lookup: the hit is the leading pages whose values were read whole (the
client checks each value's checksum), so a page is never announced that is not in memory.

Bounded: the staging pool (slots taken all or nothing when a prefetch starts), prefetches
queued or reading at once (`requests_max`). Slots are owned by exactly one of: the entry
while it reads (the reader frees the pages it could not read, or all of them when the entry
was cancelled meanwhile); the ready entry (freed by take() or cancel()); a load (the worker
gives them back once its copy from them completed).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gcache.integrations.common.job_queue import JobQueue

if TYPE_CHECKING:
    from gcache.integrations.common.guarded_store import GuardedStore
    from gcache.integrations.vllm.kv.stats import ConnectorStats
    from gcache.integrations.vllm.transfer.staging import StagingPool

log = logging.getLogger("gcache.integrations.vllm")


@dataclass
class Prefetch:
    """One request's prefetch: pages [first, first + len(slots)), one slot per (page, group)."""

    req_id: str
    first: int
    groups: list[int]  # group index of each column of `slots`
    slots: list[list[int]]  # per page, per group: its slot ([] once given back)
    keys: list[list[list[bytes]]]  # per page, per group: the value's segment keys
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    staged_end: int = 0  # once done: pages [first, staged_end) are whole in their slots
    cancelled: bool = False


class Prefetcher:
    def __init__(
        self,
        pool: StagingPool,
        store: GuardedStore,
        stats: ConnectorStats,
        spans: dict[int, list[tuple[int, int]]],
        requests_max: int,
    ) -> None:
        self.pool = pool
        self.store = store
        self.stats = stats
        self.spans = spans  # per group: (offset, length) of each segment in a value
        self.requests_max = requests_max
        self.entries: dict[str, Prefetch] = {}  # the scheduler's thread only
        self._lock = threading.Lock()  # an entry's slots and state, between the reader and the scheduler
        self.reader = JobQueue("gcache-vllm-prefetch", self._read, requests_max, log)

    # -- the scheduler's thread ---------------------------------------------------------

    def start(self, req_id: str, first: int, groups: list[int], keys: list[list[list[bytes]]]) -> bool:
        """Starts reading pages first.. (keys[p][g]: page first + p, group groups[g]); False
        (nothing started, counted) when the request has one, or there is no room."""
        if req_id in self.entries or not keys:
            return False
        if len(self.entries) >= self.requests_max:
            self.stats.count("prefetch_refused")
            return False
        taken = self.pool.take(len(keys) * len(groups))
        if taken is None:
            self.stats.count("prefetch_refused")
            return False
        per_page = len(groups)
        slots = [taken[i : i + per_page] for i in range(0, len(taken), per_page)]
        entry = Prefetch(req_id, first, groups, slots, keys, staged_end=first)
        if not self.reader.submit(entry):
            self.pool.give_back(taken)
            self.stats.count("prefetch_refused")
            return False
        self.entries[req_id] = entry
        self.stats.count("prefetches")
        return True

    def get(self, req_id: str) -> Prefetch | None:
        return self.entries.get(req_id)

    def take(self, req_id: str, start: int, end: int) -> dict[tuple[int, int], int]:
        """A ready entry's slots of pages [start, end) as {(page, group): slot}, handed to a
        load; the entry's other slots go back, and the entry is gone."""
        entry = self.entries.pop(req_id, None)
        if entry is None:
            return {}
        handed: dict[tuple[int, int], int] = {}
        spare: list[int] = []
        with self._lock:
            if not entry.done.is_set():  # not ready: nothing to hand over
                entry.cancelled = True
                return {}
            for i, row in enumerate(entry.slots):
                page = entry.first + i
                if start <= page < end and page < entry.staged_end:
                    handed.update({(page, g): s for g, s in zip(entry.groups, row)})
                else:
                    spare += row
                entry.slots[i] = []
        if spare:
            self.pool.give_back(spare)
        return handed

    def cancel(self, req_id: str) -> None:
        """The request finished, was aborted, or its prefetch took too long: its slots go back
        (now, or when its read returns)."""
        if self.drop(req_id):
            self.stats.count("prefetch_cancelled")

    def drop(self, req_id: str) -> bool:
        """cancel() without counting it (a prefetch that found nothing to load); False when
        the request had none."""
        entry = self.entries.pop(req_id, None)
        if entry is None:
            return False
        spare: list[int] = []
        with self._lock:
            entry.cancelled = True
            if entry.done.is_set():
                spare = [s for row in entry.slots for s in row]
                entry.slots = [[] for _ in entry.slots]
        if spare:
            self.pool.give_back(spare)
        return True

    def give_back(self, slots: list[int]) -> None:
        """A load's slots, once the worker's copy from them completed (any thread)."""
        self.pool.give_back(slots)

    def in_flight(self) -> int:
        return len(self.entries)

    def close(self, timeout_s: float) -> None:
        for req_id in list(self.entries):
            self.cancel(req_id)
        self.reader.close(timeout_s)

    # -- the reader thread ---------------------------------------------------------------

    def _read(self, entry: Prefetch) -> None:
        start = time.perf_counter()
        staged = 0
        try:
            with self._lock:
                cancelled = entry.cancelled
            if not cancelled:
                staged = self._read_pages(entry)
        except Exception:  # a store error or our bug: nothing staged, the request is recomputed
            log.exception("GCache connector: a prefetch failed")
            staged = 0
        finally:
            spare: list[int] = []
            with self._lock:
                entry.staged_end = entry.first + staged
                for i in range(len(entry.slots)):
                    if entry.cancelled or i >= staged:
                        spare += entry.slots[i]
                        entry.slots[i] = []
                entry.done.set()
            if spare:
                self.pool.give_back(spare)
            self.stats.count("prefetch_s", time.perf_counter() - start)

    def _read_pages(self, entry: Prefetch) -> int:
        """Reads every value into its slot: the leading pages read whole."""
        keys: list[bytes] = []
        addresses: list[int] = []
        sizes: list[int] = []
        owner: list[int] = []
        for i, (row, page_keys) in enumerate(zip(entry.slots, entry.keys)):
            for group, slot, value_keys in zip(entry.groups, row, page_keys):
                base = self.pool.address(slot)
                for key, (at, length) in zip(value_keys, self.spans[group]):
                    keys.append(key)
                    addresses.append(base + at)
                    sizes.append(length)
                    owner.append(i)
        got = self.store.get_into(keys, addresses, sizes)
        bad = {owner[j] for j, (g, n) in enumerate(zip(got, sizes)) if g != n}
        staged = min(bad, default=len(entry.slots))
        nbytes = sum(n for j, n in enumerate(sizes) if owner[j] < staged)
        self.stats.count("prefetch_pages_staged", staged)
        self.stats.count("prefetch_bytes_staged", nbytes)
        return staged
