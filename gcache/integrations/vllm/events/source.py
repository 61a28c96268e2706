"""What the connector's scheduler side announces about GCache's L3, as vLLM KV events.

The scheduler side tells it two things, without waiting (a bounded inbox; full: dropped and
counted, the scheduler never blocks on events):
  saved(pages)    pages whose saves it planned (vLLM's block hash, parent, tokens, group, keys);
  missing(pages)  pages a lookup found absent from the store (never while the store is down).
Its own thread turns them into events:
  * a saved page is announced (BlockStored) only once the store CONFIRMS it: one batched
    exists over every key of the pending pages per round (one round trip per batch, not per
    page); saves are asynchronous, so a page not there yet is asked again in later rounds,
    until confirm_s after it was planned (then `unconfirmed`, never announced);
  * an announced page found missing is withdrawn (BlockRemoved);
  * the announced pages are a bounded LRU (pages_max): beyond it the oldest are withdrawn, so
    a consumer never credits more than this connector still vouches for.
Nothing is replayed on start and no AllBlocksCleared is sent: the store outlives engines,
and what it holds is announced again as engines save or find it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gcache.serving.announce.wire import BlockHash, Event, StoredRun, block_removed, block_stored

log = logging.getLogger("gcache.integrations.vllm.events")

ROUND_S = 0.05  # pause between confirm rounds while pages wait
CONFIRM_KEYS_MAX = 8192  # keys asked per round trip
RUN_PAGES_MAX = 1024  # pages per BlockStored


class Page(NamedTuple):
    """One saved page of one KV cache group, as vLLM names it."""

    group_idx: int
    kind: str  # wire.KIND_FULL / KIND_SWA, or vLLM's kind of a state group ("mamba")
    window: int | None
    block_size: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: Sequence[int]
    keys: Sequence[bytes]  # every value key of it in the store (all ranks and segments)


class Store(Protocol):
    """What the source asks of the store (the connector's GuardedStore)."""

    @property
    def down(self) -> bool: ...

    def exists_flags(self, keys: list[bytes]) -> list[bool]: ...


@dataclass(frozen=True)
class SourceLimits:
    pages_max: int = 1 << 18  # announced pages remembered (LRU); the oldest are withdrawn beyond
    inbox_max: int = 4096  # scheduler notices waiting for the thread
    pending_max: int = 1 << 16  # saved pages waiting for their confirmation
    confirm_s: float = 30.0  # how long a saved page may take to show up in the store


class _Pending(NamedTuple):
    page: Page
    since: float


class L3EventSource:
    def __init__(
        self,
        store: Store,
        publish: Callable[[list[Event]], bool],
        limits: SourceLimits = SourceLimits(),
        clock: Callable[[], float] = time.monotonic,
        start_thread: bool = True,
    ) -> None:
        self.store, self.publish, self.limits, self.clock = store, publish, limits, clock
        self.inbox: queue.Queue[tuple[str, list[Page]]] = queue.Queue(maxsize=limits.inbox_max)
        self.pending: OrderedDict[tuple[int, BlockHash], _Pending] = OrderedDict()
        self.announced: OrderedDict[tuple[int, BlockHash], None] = OrderedDict()
        self.stats = dict.fromkeys(
            (
                "notices_dropped",
                "pending_dropped",
                "confirm_rounds",
                "announced",
                "unconfirmed",
                "removed_missing",
                "withdrawn_lru",
                "missing_while_down",
                "publish_dropped",
            ),
            0,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="gcache-l3-events", daemon=True)
            self._thread.start()

    # ---- the scheduler's side: never blocks ---------------------------------------------------
    def _notify(self, what: str, pages: list[Page]) -> None:
        if not pages:
            return
        try:
            self.inbox.put_nowait((what, pages))
        except queue.Full:
            self.stats["notices_dropped"] += 1

    def saved(self, pages: list[Page]) -> None:
        self._notify("saved", pages)

    def missing(self, pages: list[Page]) -> None:
        self._notify("missing", pages)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once(wait_s=ROUND_S if self.pending else 0.5)
            except Exception:  # a bug must not end announcements (nor the engine)
                log.exception("GCache KV events: round failed")
                self._stop.wait(ROUND_S)

    def run_once(self, wait_s: float = 0.0) -> None:
        """One round: take the notices, confirm what waits, publish what changed."""
        events: list[Event] = []
        try:
            notices = [self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()]
        except queue.Empty:
            notices = []
        while True:
            try:
                notices.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for what, pages in notices:
            if what == "saved":
                self._pend(pages)
            else:
                events += self._gone(pages)
        events += self._confirm()
        if events and not self.publish(events):
            self.stats["publish_dropped"] += 1

    def _pend(self, pages: list[Page]) -> None:
        now = self.clock()
        for page in pages:
            key = (page.group_idx, page.block_hash)
            if key in self.announced:
                self.announced.move_to_end(key)  # saved again: still vouched for, freshly
                continue
            if key not in self.pending and len(self.pending) >= self.limits.pending_max:
                self.stats["pending_dropped"] += 1
                continue
            self.pending[key] = _Pending(page, now)

    def _gone(self, pages: list[Page]) -> list[Event]:
        if self.store.down:  # the store does not answer: a miss says nothing about what it holds
            self.stats["missing_while_down"] += len(pages)
            return []
        by_group: dict[int, list[BlockHash]] = {}
        for page in pages:
            key = (page.group_idx, page.block_hash)
            # (a pending page stays pending: its save may still be in flight)
            if key in self.announced:
                del self.announced[key]
                by_group.setdefault(page.group_idx, []).append(page.block_hash)
                self.stats["removed_missing"] += 1
        return [block_removed(g, hashes) for g, hashes in by_group.items()]

    def _confirm(self) -> list[Event]:
        """One exists round trip over the oldest pending pages; the confirmed ones announced."""
        if not self.pending:
            return []
        now = self.clock()
        for key in [k for k, p in self.pending.items() if now - p.since > self.limits.confirm_s]:
            del self.pending[key]
            self.stats["unconfirmed"] += 1
        batch: list[Page] = []
        keys: list[bytes] = []
        for p in self.pending.values():
            if batch and len(keys) + len(p.page.keys) > CONFIRM_KEYS_MAX:
                break
            batch.append(p.page)
            keys += p.page.keys
        if not batch:
            return []
        flags = self.store.exists_flags(keys)
        self.stats["confirm_rounds"] += 1
        if self.store.down:
            return []  # asked again next round (until confirm_s)
        confirmed, at = [], 0
        for page in batch:
            n = len(page.keys)
            if n and all(flags[at : at + n]):
                confirmed.append(page)
                del self.pending[(page.group_idx, page.block_hash)]
            at += n
        # Pages not yet there move to the back: the next round asks the others first.
        for page in batch:
            key = (page.group_idx, page.block_hash)
            if key in self.pending:
                self.pending.move_to_end(key)
        return self._announce(confirmed)

    def _announce(self, pages: list[Page]) -> list[Event]:
        events = [block_stored(run) for run in runs(pages)]
        withdrawn: dict[int, list[BlockHash]] = {}
        for page in pages:
            self.announced[(page.group_idx, page.block_hash)] = None
            self.announced.move_to_end((page.group_idx, page.block_hash))
            self.stats["announced"] += 1
        while len(self.announced) > self.limits.pages_max:
            (group, h), _ = self.announced.popitem(last=False)
            withdrawn.setdefault(group, []).append(h)
            self.stats["withdrawn_lru"] += 1
        return events + [block_removed(g, hashes) for g, hashes in withdrawn.items()]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def runs(pages: list[Page]) -> list[StoredRun]:
    """Pages grouped into BlockStored runs: same group, each page's parent the one before."""
    groups: list[tuple[Page, list[BlockHash], list[int]]] = []
    for page in pages:
        if groups:
            first, hashes, tokens = groups[-1]
            if first.group_idx == page.group_idx and hashes[-1] == page.parent_hash and len(hashes) < RUN_PAGES_MAX:
                hashes.append(page.block_hash)
                tokens.extend(page.token_ids)
                continue
        groups.append((page, [page.block_hash], list(page.token_ids)))
    return [
        StoredRun(first.group_idx, first.kind, first.window, first.block_size, first.parent_hash, hashes, tokens)
        for first, hashes, tokens in groups
    ]
