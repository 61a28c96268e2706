"""The connector's save and load state machines, written against the BlockMover contract only, so
the same code runs on CPU KV (HostMover), on the tests' StandInDevice and on a GPU (CudaMover).

Save (wait_for_save, once per step, after vLLM queued the step's forward): the pages this step
completed take staging slots (as many as are free, in order: the rest is dropped and counted),
the save stream waits for an event on the compute stream, one batched copy gathers each page's
layers into its slot, and an event marks the copy. The GPU blocks are free from that event on,
not after the put: a finished request is reported sent once its copies completed, and when
sliding-window blocks (which vLLM reuses next step) or preempted requests' blocks were saved,
the compute stream itself waits for the copy. The put runs on the saver thread: it waits for the
copy's event, probes which values the store lacks, writes them from the slots, frees the slots.

Load (asynchronous, the default): start_load records an event on the compute stream (vLLM's
work on the allocated blocks so far); the loader thread reads the values into load slots in
chunks, and for each chunk the load stream waits for that event, one batched copy scatters the
values into the blocks, and the thread waits for the copy before reusing the slots. A value that
is missing, short, or fails its checksum (the client verifies XXH3 on the slot's bytes before
anything reaches the device) is never copied: its blocks are reported failed and vLLM
recomputes them. Synchronous loads run the same way inside start_load, with the compute stream
waiting for the copy before the forward.

Direct loads (CPU KV, the store on this host over shm, one segment per value): no slot and no
second copy. One LOOKUP, then one native pass copies each value from the store's shared memory
into its blocks' runs, after checking the value's checksum on those bytes (a value that fails
writes nothing: its blocks are recomputed). Sync and async loads both go this way then.

Staged loads (the scheduler's prefetch read the values already, kv/prefetch.py) skip the read:
one batched copy from the staged slots into the blocks, in the step or on the loader thread;
the slots go back (`release`) once that copy completed.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from gcache.client.scatter import ScatterRuns
from gcache.integrations.common.job_queue import JobQueue
from gcache.integrations.vllm.transfer import digests
from gcache.integrations.vllm.transfer.movers.base import BlockMover, Event
from gcache.integrations.vllm.transfer.values import Copies
from gcache.wire.worth import ValueKind, Worth

if TYPE_CHECKING:
    from gcache.integrations.common.guarded_store import GuardedStore
    from gcache.integrations.vllm.kv.settings import ConnectorSettings
    from gcache.integrations.vllm.kv.stats import ConnectorStats
    from gcache.integrations.vllm.transfer.staging import StagingPool
    from gcache.integrations.vllm.transfer.values import GroupValues

log = logging.getLogger("gcache.integrations.vllm")
LOAD_SLOT_WAIT_S = 30.0  # longest the loader waits for load slots held by synchronous loads


class Page(NamedTuple):
    group: int  # KV cache group index
    keys: list[bytes]  # the value's segment keys
    block_id: int
    worth: Worth | None = None  # a save's: told to the node (each segment its share of the cost)


UNSAID = Worth(ValueKind.OTHER, 0)  # a value saved without a worth, in a batch with some


class PutJob(NamedTuple):
    keys: list[bytes]
    addresses: list[int]
    sizes: list[int]
    slots: list[int]
    copied: Event  # the mover's event: the slots hold the bytes once it completed
    swa_values: int  # values of sliding-window groups, for the counters
    worth: list[Worth] | None = None  # per key, the PUT's "worth" (None: not said)


class LoadJob(NamedTuple):
    req_id: str
    pages: list[Page]
    after: Event  # event on the compute stream when the load was planned
    staged: Staged | None = None  # the values are in staging already: copy only


class Staged(NamedTuple):
    """Values a prefetch read already: where each page's value lies, and who gets the memory back."""

    addresses: np.ndarray  # int64, one per page
    release: Callable[[], None]  # once the copy from them completed


def _u64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.uint64)


def _concat(parts: list[Copies]) -> Copies:
    if len(parts) == 1:
        return parts[0]
    return Copies(*(np.concatenate([getattr(p, f) for p in parts]) for f in Copies._fields))


class Transfers:
    """Both directions for one worker: `values` per group index (values.GroupValues)."""

    def __init__(
        self,
        mover: BlockMover,
        values: dict[int, GroupValues],
        swa_groups: set[int],
        save_pool: StagingPool,
        load_pool: StagingPool,
        store: GuardedStore,
        stats: ConnectorStats,
        settings: ConnectorSettings,
    ) -> None:
        self.mover = mover
        self.values = values
        self.swa_groups = swa_groups
        self.save_pool = save_pool
        self.load_pool = load_pool
        self.store = store
        self.stats = stats
        self.skip_existing = settings.skip_existing
        # Straight from the store's shared memory into host KV (module text): memcpys need host
        # blocks, and a segmented value's runs could straddle its segments.
        self.direct = (
            settings.direct_loads
            and mover.name == "host"
            and store.can_scatter
            and all(v.segments == 1 for v in values.values())
        )
        self.save_stream = mover.new_stream("save")
        self.load_stream = mover.new_stream("load")
        self.saver = JobQueue("gcache-vllm-saver", self._put, settings.save_queue_jobs_max, log)
        self.loader = JobQueue("gcache-vllm-loader", self._load_async, settings.load_queue_jobs_max, log)
        self._lock = threading.Lock()
        self._copies: list[tuple[Event, frozenset[str]]] = []  # (copy event, request ids) not known complete
        self._last_copy: Event | None = None  # the save stream's newest event
        self._landing: list[tuple[Event, Callable[[], None]]] = []  # synchronous loads: (copy event, release)
        self._done: list[tuple[str, set[int]]] = []  # asynchronous loads: (request id, failed blocks)
        self._loads_running = 0  # asynchronous loads submitted, not in _done yet
        self._done_cv = threading.Condition(self._lock)
        self.digests = digests.from_env()  # debug only (digests.py)

    # -- saves --------------------------------------------------------------------------

    def _gather(self, pages: list[Page], slots: list[int]) -> Copies:
        addresses = self.save_pool.addresses(slots)
        parts: list[Copies] = []
        for g, values in self.values.items():
            mine = [i for i, p in enumerate(pages) if p.group == g]
            if mine:
                parts.append(values.gather([pages[i].block_id for i in mine], addresses[mine]))
        return _concat(parts)

    def save(self, pages: list[Page], req_ids: list[str], reused_next_step: bool) -> None:
        """Queues the save of `pages` (Page...; req_ids[i] owns pages[i]). `reused_next_step`:
        some of these blocks go back to vLLM's pool after this step (sliding-window blocks)."""
        if not pages:
            return
        self.stats.count("save_values_offered", sum(len(p.keys) for p in pages))
        if not self.saver.has_room():
            self._dropped("save_pages_dropped", pages)
            return
        slots = self.save_pool.take_up_to(len(pages))
        if len(slots) < len(pages):  # the pool is full: the prefix first (a later page alone is never read)
            self._dropped("save_pages_dropped_staging", pages[len(slots) :])
            pages, req_ids = pages[: len(slots)], req_ids[: len(slots)]
            if not pages:
                return
        compute = self.mover.compute_stream()
        self.mover.wait_event(self.save_stream, self.mover.record(compute))
        copies = self._gather(pages, slots)
        self.mover.copy(self.save_stream, copies.dst, copies.src, copies.sizes)
        copied = self.mover.record(self.save_stream)
        if reused_next_step:
            self.mover.wait_event(compute, copied)
        if self.digests is not None:
            self._log_values("S", pages, self.save_pool.addresses(slots), copied, "save")
        keys: list[bytes] = []
        addresses: list[int] = []
        sizes: list[int] = []
        worth: list[Worth] = []
        swa = 0
        for page, address in zip(pages, self.save_pool.addresses(slots)):
            spans = self.values[page.group].segment_spans()
            total = sum(length for _, length in spans) or 1
            for key, (at, length) in zip(page.keys, spans):
                keys.append(key)
                addresses.append(int(address) + at)
                sizes.append(length)
                # A segment spares its share (cost per byte kept); cost 0: not said.
                said = page.worth or UNSAID
                worth.append(Worth(said.kind, -(-said.cost * length // total)))
            swa += page.group in self.swa_groups
        with self._lock:
            self._copies.append((copied, frozenset(req_ids)))
            self._last_copy = copied
        told = worth if any(p.worth is not None for p in pages) else None
        if not self.saver.submit(PutJob(keys, addresses, sizes, slots, copied, swa, told)):  # closed meanwhile
            self.mover.synchronize(copied)
            self.save_pool.give_back(slots)
            self._dropped("save_pages_dropped", pages)

    def _dropped(self, reason: str, pages: list[Page]) -> None:
        self.stats.count(reason, len(pages))
        self.stats.count("save_values_dropped", sum(len(p.keys) for p in pages))

    def _put(self, job: PutJob) -> None:
        start = time.perf_counter()
        try:
            self.mover.synchronize(job.copied)
            todo: Sequence[int] = range(len(job.keys))
            if self.skip_existing:  # a shared prefix costs one EXISTS entry, not its bytes
                present = self.store.exists_flags(job.keys)
                todo = [i for i, ok in enumerate(present) if not ok]
                self.stats.count("values_skipped_existing", len(job.keys) - len(todo))
            if todo:
                done = self.store.put_from(
                    [job.keys[i] for i in todo],
                    [job.addresses[i] for i in todo],
                    [job.sizes[i] for i in todo],
                    None if job.worth is None else [job.worth[i] for i in todo],
                )
                saved = [i for i, ok in zip(todo, done) if ok]
                self.stats.count("values_saved", len(saved))
                self.stats.count("bytes_saved", sum(job.sizes[i] for i in saved))
                self.stats.count("values_save_failed", len(todo) - len(saved))
            self.stats.count("swa_values_saved", job.swa_values)
        finally:
            self.save_pool.give_back(job.slots)
            self.stats.count("save_s", time.perf_counter() - start)

    def _log_values(self, kind: str, pages: list[Page], addresses: np.ndarray, copied: Event, tag: str) -> None:
        """Debug (digests.py): each page's value as staged at `addresses`."""
        log_ = self.digests
        if log_ is None:
            return
        self.mover.synchronize(copied)
        for page, address in zip(pages, addresses):
            nbytes = self.values[page.group].value_bytes
            digest = digests.digest_at(int(address), nbytes)
            log_.line(kind, page.keys[0], digest, page.block_id, tag)
            if kind == "S":
                log_.keep(page.keys[0], digest, int(address), nbytes)

    def _log_loaded(self, pages: list[Page], addresses: np.ndarray, ok: Sequence[int], copied: Event, tag: str) -> None:
        """Debug (digests.py): each loaded page's value as read (R) and as its block holds it
        after the copy (L), gathered back out of the block."""
        log_ = self.digests
        if log_ is None:
            return
        self.mover.synchronize(copied)
        mine = [pages[i] for i in ok]
        self._log_values("R", mine, np.asarray(addresses)[list(ok)], copied, tag)
        self._log_blocks(mine, tag)

    def _log_blocks(self, pages: list[Page], tag: str) -> None:
        """Debug (digests.py): each page's value as its block holds it (L), gathered back out."""
        log_ = self.digests
        if log_ is None:
            return
        for page in pages:
            values = self.values[page.group]
            buf, base = digests.host_buffer(values.value_bytes)
            back = values.gather([page.block_id], [base])
            self.mover.copy(self.load_stream, back.dst, back.src, back.sizes)
            self.mover.synchronize(self.mover.record(self.load_stream))
            log_.line("L", page.keys[0], digests.digest_at(base, values.value_bytes), page.block_id, tag)
            del buf

    def copies_pending(self, req_ids: set[str]) -> set[str]:
        """The requests among `req_ids` whose blocks a save still copies from (never blocks)."""
        with self._lock:
            self._copies = [(ev, reqs) for ev, reqs in self._copies if not self.mover.query(ev)]
            return {r for _, reqs in self._copies for r in reqs if r in req_ids}

    def blocks_freed(self) -> None:
        """vLLM freed blocks a save may still read (preemption): the compute stream waits."""
        with self._lock:
            last = self._last_copy
        if last is not None:
            self.mover.wait_event(self.mover.compute_stream(), last)

    # -- loads --------------------------------------------------------------------------

    def _fetch(self, pages: list[Page], slots: list[int]) -> tuple[list[int], set[int]]:
        """Reads the values into slots: (pages read whole, blocks that failed)."""
        keys: list[bytes] = []
        addresses: list[int] = []
        sizes: list[int] = []
        owner: list[int] = []
        for i, (page, address) in enumerate(zip(pages, self.load_pool.addresses(slots))):
            for key, (at, length) in zip(page.keys, self.values[page.group].segment_spans()):
                keys.append(key)
                addresses.append(int(address) + at)
                sizes.append(length)
                owner.append(i)
        got = self.store.get_into(keys, addresses, sizes)
        bad = {owner[j] for j, (g, n) in enumerate(zip(got, sizes)) if g != n}
        ok = [i for i in range(len(pages)) if i not in bad]
        self.stats.count("values_loaded", len(ok))
        self.stats.count("bytes_loaded", sum(self.values[pages[i].group].value_bytes for i in ok))
        self.stats.count("load_failed_values", len(bad))
        return ok, {pages[i].block_id for i in bad}

    def _fetch_direct(self, pages: list[Page]) -> set[int]:
        """Reads the values straight into their blocks (module text): the blocks that failed.
        The runs come from numpy per group; one call copies them all."""
        keys: list[bytes] = []
        sizes: list[int] = []
        owner: list[int] = []  # page index of each key
        parts: list[Copies] = []
        counts: list[np.ndarray] = []
        for g, values in self.values.items():
            mine = [i for i, p in enumerate(pages) if p.group == g]
            if not mine:
                continue
            # From slot address 0: each run's source is its offset within the value.
            parts.append(values.scatter(np.zeros(len(mine), dtype=np.int64), [pages[i].block_id for i in mine]))
            keys += [pages[i].keys[0] for i in mine]
            sizes += [values.value_bytes] * len(mine)
            owner += mine
            counts.append(np.full(len(mine), values.runs_per_page, dtype=np.uint64))
        if not keys:
            return set()
        copies = _concat(parts)
        first = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(np.concatenate(counts), dtype=np.uint64)))
        runs = ScatterRuns(sizes, first, _u64(copies.dst), _u64(copies.src), _u64(copies.sizes))
        got = self.store.get_scatter(keys, runs)
        bad = {owner[j] for j, (n, want) in enumerate(zip(got, sizes)) if n != want}
        loaded = len(keys) - len(bad)
        self.stats.count("values_loaded", loaded)
        self.stats.count("values_loaded_direct", loaded)
        self.stats.count("bytes_loaded", sum(n for j, n in enumerate(sizes) if owner[j] not in bad))
        self.stats.count("load_failed_values", len(bad))
        if self.digests is not None:
            self._log_blocks([p for i, p in enumerate(pages) if i not in bad], "direct")
        return {pages[i].block_id for i in bad}

    def _scatter(self, pages: list[Page], slots: list[int], ok: list[int], after: Event) -> Event:
        """Queues the copies of the pages read whole into their blocks; the copy's event."""
        return self._scatter_from(pages, self.load_pool.addresses(slots), ok, after)

    def _scatter_from(self, pages: list[Page], addresses: np.ndarray, ok: list[int], after: Event) -> Event:
        parts: list[Copies] = []
        for g, values in self.values.items():
            mine = [i for i in ok if pages[i].group == g]
            if mine:
                parts.append(values.scatter(addresses[mine], [pages[i].block_id for i in mine]))
        self.mover.wait_event(self.load_stream, after)
        if parts:
            copies = _concat(parts)
            self.mover.copy(self.load_stream, copies.dst, copies.src, copies.sizes)
        return self.mover.record(self.load_stream)

    def load_now(self, pages: list[Page]) -> set[int]:
        """A synchronous load, before this step's forward: the blocks that failed. A load larger
        than half the load pool goes in chunks (each chunk's copy completes before its slots
        are read into again)."""
        self._reap_landed()
        start = time.perf_counter()
        if self.direct:
            try:
                return self._fetch_direct(pages)
            finally:
                self.stats.count("load_s", time.perf_counter() - start)
        chunk = max(1, self.load_pool.slot_count // 2)  # leaves room for the loader thread
        failed: set[int] = set()
        compute = self.mover.compute_stream()
        for at in range(0, len(pages), chunk):
            part = pages[at : at + chunk]
            slots = self.load_pool.take(len(part))
            if slots is None:
                self.stats.count("load_values_no_staging", len(pages) - at)
                failed |= {p.block_id for p in pages[at:]}
                break
            try:
                ok, bad = self._fetch(part, slots)
            except Exception:
                self.load_pool.give_back(slots)
                raise
            failed |= bad
            copied = self._scatter(part, slots, ok, self.mover.record(compute))
            if self.digests is not None:
                self._log_loaded(part, self.load_pool.addresses(slots), ok, copied, "sync")
            self.mover.wait_event(compute, copied)  # the forward reads the blocks after the copy
            if at + chunk < len(pages):
                self.mover.synchronize(copied)
                self.load_pool.give_back(slots)
            else:
                with self._lock:
                    self._landing.append((copied, functools.partial(self.load_pool.give_back, slots)))
        self.stats.count("load_s", time.perf_counter() - start)
        return failed

    def load_staged_now(self, pages: list[Page], staged: Staged) -> None:
        """A synchronous load of staged values, before this step's forward (a copy only)."""
        self._reap_landed()
        start = time.perf_counter()
        compute = self.mover.compute_stream()
        try:
            copied = self._scatter_from(pages, staged.addresses, list(range(len(pages))), self.mover.record(compute))
        except Exception:
            staged.release()
            raise
        self.mover.wait_event(compute, copied)
        if self.digests is not None:
            self._log_loaded(pages, staged.addresses, range(len(pages)), copied, "staged-sync")
        with self._lock:
            self._landing.append((copied, staged.release))
        self._count_staged(pages, time.perf_counter() - start)

    def _count_staged(self, pages: list[Page], seconds: float) -> None:
        self.stats.count("staged_values_loaded", len(pages))
        self.stats.count("staged_bytes_loaded", sum(self.values[p.group].value_bytes for p in pages))
        self.stats.count("staged_load_s", seconds)

    def _reap_landed(self) -> None:
        with self._lock:
            landed = [(ev, release) for ev, release in self._landing if self.mover.query(ev)]
            self._landing = [x for x in self._landing if x not in landed]
        for _, release in landed:
            release()

    def load_later(self, req_id: str, pages: list[Page], staged: Staged | None = None) -> None:
        """An asynchronous load; its outcome comes back from take_loaded()."""
        job = LoadJob(req_id, pages, self.mover.record(self.mover.compute_stream()), staged)
        with self._lock:
            self._loads_running += 1
        if not self.loader.submit(job):
            self.stats.count("loads_refused_queue_full")
            if staged is not None:
                staged.release()
            with self._lock:
                self._loads_running -= 1
                self._done.append((req_id, {p.block_id for p in pages}))

    def _load_async(self, job: LoadJob) -> None:
        if job.staged is not None:
            self._load_staged_async(job, job.staged)
            return
        failed: set[int] = set()
        start = time.perf_counter()
        try:
            if self.direct:
                failed = self._fetch_direct(job.pages)
                return
            chunk = max(1, self.load_pool.slot_count // 2)  # leaves room for synchronous loads
            for at in range(0, len(job.pages), chunk):
                pages = job.pages[at : at + chunk]
                slots = self._take_load_slots(len(pages))
                if slots is None:
                    failed |= {p.block_id for p in job.pages[at:]}
                    self.stats.count("load_values_no_staging", len(job.pages) - at)
                    break
                try:
                    ok, bad = self._fetch(pages, slots)
                    failed |= bad
                    copied = self._scatter(pages, slots, ok, job.after)
                    self.mover.synchronize(copied)
                    if self.digests is not None:
                        self._log_loaded(pages, self.load_pool.addresses(slots), ok, copied, "async")
                finally:
                    self.load_pool.give_back(slots)
        except Exception:  # our bug or a store error: these blocks are recomputed
            log.exception("GCache connector: a load failed")
            failed = {p.block_id for p in job.pages}
        finally:
            self.stats.count("load_s", time.perf_counter() - start)
            self._finish(job.req_id, failed)

    def _load_staged_async(self, job: LoadJob, staged: Staged) -> None:
        failed: set[int] = set()
        start = time.perf_counter()
        try:
            copied = self._scatter_from(job.pages, staged.addresses, list(range(len(job.pages))), job.after)
            self.mover.synchronize(copied)
            if self.digests is not None:
                self._log_loaded(job.pages, staged.addresses, range(len(job.pages)), copied, "staged-async")
            self._count_staged(job.pages, time.perf_counter() - start)
        except Exception:  # our bug: these blocks are recomputed
            log.exception("GCache connector: a staged load failed")
            failed = {p.block_id for p in job.pages}
        finally:
            staged.release()
            self._finish(job.req_id, failed)

    def _finish(self, req_id: str, failed: set[int]) -> None:
        with self._lock:
            self._loads_running -= 1
            self._done.append((req_id, failed))
            self._done_cv.notify_all()

    def wait_loaded(self, timeout_s: float) -> None:
        """Waits (bounded) until an asynchronous load in flight finishes; at once when none is."""
        with self._done_cv:
            self._done_cv.wait_for(lambda: self._done or not self._loads_running, timeout_s)

    def _take_load_slots(self, count: int) -> list[int] | None:
        deadline = time.monotonic() + LOAD_SLOT_WAIT_S
        while True:
            self._reap_landed()
            slots = self.load_pool.take(count)
            if slots is not None or time.monotonic() > deadline:
                return slots
            time.sleep(0.005)  # synchronous loads hold slots only until their copy lands

    def take_loaded(self) -> list[tuple[str, set[int]]]:
        """Asynchronous loads finished since the last call: (request id, failed blocks)."""
        self._reap_landed()
        with self._lock:
            done, self._done = self._done, []
        return done

    # -- the end ------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        return self.saver.wait_idle(timeout_s)

    def close(self, timeout_s: float) -> None:
        self.saver.close(timeout_s)
        self.loader.close(timeout_s)
