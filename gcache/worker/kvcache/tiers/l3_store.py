"""L3: the worker's side of GCache. Host pages go to the store and come back through
`gcache.Client`, straight from and into the host pool's buffers (registered once).

Off the engine's critical path: writes are queued (bounded; a full queue drops the write
and counts it) and run on writer threads; prefetches run on prefetch threads. The same
queue and threads carry small opaque blobs (`submit_blob`: the `mtp` pool's MTP tails),
so `drain()` and `idle()` cover them too. Every call has the client's timeout, and after
a failure the store is skipped for `suspect_s`, so a dead, slow or restarting
gcache-server costs misses, never a stalled decode.

Health: the first failure of an outage logs that L3 is unreachable and the first answer
after it logs that it answers again (gcache.common.breaker's down/up edges); health()
says which, and when the store last answered (the worker's /health). probe() asks the
store once (a PING); watch() starts a thread that probes only when nothing else has
told: every `probe_s` while the store is down, or after `probe_s` without an answer while
it is up. The worker probes at start and watches; an Engine built alone does not.

Keys: one per page per pool, `KeyBuilder(model, ...).key(page_hash, "full" | "swa")`, so a
worker restarted with the same model name finds its pages and another model never does.
A prefix is usable from L3 up to its last window-safe point whose full pages are all
there (SWA pages exist only at checkpoints). Reads verify checksums: a corrupt or missing
page cuts the prefix there (the rest is recomputed); wrong bytes are never loaded.

Hot chains (failure mode 3): the writer stores a chain suffix-first and then probes its
prefix pages (an EXISTS is a use for the node's S3-FIFO), and the prefetcher probes a
chain from page 0, so a hot chain's page 0 outlives its suffix pages on the node.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gcache import errors
from gcache.common.attention import AttentionKind
from gcache.common.breaker import Breaker
from gcache.serving.swa_window import last_safe_end, tail_start_page
from gcache.serving.tiers import Tier
from gcache.wire.keys import KeyBuilder
from gcache.worker.kvcache.tiers.host_cache import HostCache

log = logging.getLogger("gcache.worker.l3")
TOUCH_PAGES_MAX = 64  # prefix pages probed after a write (bounded work per write)
PROBE_PAGES_MAX = 4096  # pages one prefetch may look at


@dataclass(frozen=True)
class L3Config:
    url: str
    model: str
    timeout_s: float = 2.0
    suspect_s: float = 2.0
    write_queue_max: int = 256
    writer_threads: int = 1
    prefetch_threads: int = 2
    prefetch_queue_max: int = 64
    protect_prefix: bool = True  # suffix-first writes + prefix probes (failure mode 3)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "suspect_s"):
            if not 0 < getattr(self, name) <= 600:
                raise ValueError(f"L3Config.{name} must be in (0, 600]")
        for name in ("write_queue_max", "writer_threads", "prefetch_threads", "prefetch_queue_max"):
            if not 1 <= getattr(self, name) <= 4096:
                raise ValueError(f"L3Config.{name} must be in [1, 4096]")


@dataclass
class WriteJob:
    pages: list  # (page hash, full slot, swa slot | None), chain order, pinned in L2
    touch: list[str]  # the chain's first page hashes, to probe after the write
    enqueued_s: float = 0.0

    @property
    def keys(self) -> list[str]:
        return [h for h, _, _ in self.pages]


@dataclass
class BlobJob:
    """One opaque value for L3 (an MTP tail): stored with a plain put, nothing pinned."""

    key: bytes
    blob: bytes
    on_error: Callable[[], None] | None = None  # called on the writer thread if the put fails


@dataclass
class Prefetch:
    """One waiting request's L3 read: pages [start, ready_end) land in L2, pinned for it."""

    keys: list[str]
    start: int
    started_s: float
    ready_end: int = 0
    fetched: set = field(default_factory=set)  # hashes read from L3 by this prefetch
    pinned: list = field(default_factory=list)  # L2 keys pinned on the request's behalf
    outcome: str = "pending"  # hit | miss | failed | dropped | cancelled
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: bool = False


class L3Store:
    def __init__(self, config: L3Config, host: HostCache, window: int, page_size: int, client=None) -> None:
        import gcache

        self.config = config
        self.host = host
        self.window, self.page_size = window, page_size
        self.keys = KeyBuilder(model=config.model.replace("/", "-"))
        self.client = (
            client
            if client is not None
            else gcache.Client(
                config.url,
                timeout_s=config.timeout_s,
                connect_timeout_s=min(0.5, config.timeout_s),
                retries=1,
                verify_checksums=True,
            )
        )
        self.pool = host.pool
        for kind in (AttentionKind.FULL, AttentionKind.SWA):
            if self.pool.page_bytes[kind] and self.pool.pools[kind].num_pages:
                self.client.register_buffer(self.pool.buffer(kind))
        self._breaker = Breaker(config.suspect_s)
        self._lock = threading.Lock()
        self._last_seen_wall: float | None = None  # time.time() of the store's last answer
        self._last_seen: float = float("-inf")  # the same, time.monotonic()
        self._down_since_wall: float | None = None
        self._last_error: str | None = None
        self._health_lock = threading.Lock()  # the down/up edges and what health() reports of them
        self.stats = dict.fromkeys(
            (
                "writes_queued",
                "writes_dropped",
                "blob_writes_queued",
                "blob_writes_dropped",
                "blob_write_errors",
                "blob_write_bytes",
                "write_pages",
                "write_bytes",
                "write_errors",
                "write_seconds",
                "prefetches",
                "prefetch_hit",
                "prefetch_miss",
                "prefetch_failed",
                "prefetch_dropped",
                "prefetch_cancelled",
                "read_pages",
                "read_bytes",
                "read_seconds",
                "read_bad_pages",
                "touch_probes",
            ),
            0,
        )
        self._writes: queue.Queue = queue.Queue(maxsize=config.write_queue_max)
        self._prefetches: queue.Queue = queue.Queue(maxsize=config.prefetch_queue_max)
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._write_loop, name=f"l3-writer-{i}", daemon=True)
            for i in range(config.writer_threads)
        ]
        self._threads += [
            threading.Thread(target=self._prefetch_loop, name=f"l3-prefetch-{i}", daemon=True)
            for i in range(config.prefetch_threads)
        ]
        for t in self._threads:
            t.start()

    # ---- health --------------------------------------------------------------------------
    def available(self) -> bool:
        return not self._breaker.is_suspect()

    def _failed(self, exc: BaseException | None = None) -> None:
        """A call to the store failed: skip it for suspect_s; the first failure of an
        outage says so in the log."""
        error = " ".join(f"{type(exc).__name__}: {exc}".split()) if exc is not None else "call failed"
        with self._health_lock:  # health() sees the state, its time and its error together
            self._last_error = error
            first = self._breaker.fail()
            if first:
                self._down_since_wall = time.time()
        if first:
            log.warning(
                "L3 %s is unreachable (%s): serving without it (no L3 reads or writes), "
                "trying it again every %.1fs; /health shows when it answers",
                self.config.url,
                error,
                self.config.suspect_s,
            )

    def _answered(self) -> None:
        """The store answered a call: it is up; the first answer after an outage says so."""
        self._last_seen_wall, self._last_seen = time.time(), time.monotonic()
        if not self._breaker.is_down():  # the common case, without the lock
            return
        with self._health_lock:
            back = self._breaker.succeed()
            down_since, self._down_since_wall = self._down_since_wall, None
        if back:
            down_s = self._last_seen_wall - (down_since or self._last_seen_wall)
            log.warning("L3 %s answers again (unreachable for %.1fs); using it again", self.config.url, down_s)

    def probe(self) -> bool:
        """Ask the store once (PING, bounded by the client's timeout); True if it answered.
        A ClusterClient answers per node: up if any node did."""
        try:
            answer = self.client.ping()
        except (errors.GCacheError, OSError) as exc:
            self._failed(exc)
            return False
        if isinstance(answer, dict) and "version" not in answer:  # a cluster: {node: answer or error}
            if not any(isinstance(v, dict) for v in answer.values()):
                self._failed(RuntimeError("; ".join(f"{n}: {v}" for n, v in answer.items()) or "no live node"))
                return False
        self._answered()
        return True

    def health(self) -> dict:
        """For /health: state "up", "unreachable" or "unknown" (never asked yet), when the
        store last answered (UTC, ISO 8601, and seconds ago), since when it has been
        unreachable, and the last error."""

        def iso(t: float | None) -> str | None:
            return None if t is None else datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()

        with self._health_lock:
            down, down_since, error = self._breaker.is_down(), self._down_since_wall, self._last_error
        seen = self._last_seen_wall
        state = "unreachable" if down else "up" if seen is not None else "unknown"
        return {
            "state": state,
            "address": self.config.url,
            "last_seen": iso(seen),
            "last_seen_s_ago": None if seen is None else round(max(0.0, time.time() - seen), 3),
            "unreachable_since": iso(down_since) if down else None,
            "last_error": error if down else None,
        }

    def watch(self, probe_s: float | None = None) -> None:
        """Start the health thread: a probe every probe_s (default suspect_s) while the
        store is down and not being tried by traffic, or after probe_s without any answer
        while it is up; it sleeps otherwise. Stopped by close()."""
        every = probe_s or self.config.suspect_s
        t = threading.Thread(target=self._watch_loop, args=(every,), name="l3-health", daemon=True)
        self._threads.append(t)
        t.start()

    def _watch_loop(self, every: float) -> None:
        while not self._stopping.wait(every):
            if self._breaker.is_down():
                if not self._breaker.is_suspect():  # its window is over and no call tried it yet
                    self.probe()
            elif time.monotonic() - self._last_seen >= every:
                self.probe()

    def _count(self, **by) -> None:
        with self._lock:
            for k, v in by.items():
                self.stats[k] += v

    def stats_snapshot(self) -> dict[str, float]:
        """A consistent copy of the counters (the writer and prefetch threads update them)."""
        with self._lock:
            return dict(self.stats)

    def write_queue_depth(self) -> int:
        return self._writes.qsize()

    def idle(self) -> bool:
        # unfinished_tasks counts a job from put() to task_done(): no gap between a thread
        # taking a job off its queue and starting it (its pages are pinned all along).
        return self._writes.unfinished_tasks == 0 and self._prefetches.unfinished_tasks == 0

    # ---- writes --------------------------------------------------------------------------
    def submit_write(self, pages: list, touch: list[str]) -> bool:
        """Queue pages (claimed with HostCache.claim_for_l3 by the caller) for L3. False:
        dropped (queue full or store down); the caller hands them back with finish_l3."""
        if not pages:
            return True
        if not self.available():
            self._count(writes_dropped=1)
            return False
        try:
            self._writes.put_nowait(WriteJob(pages, touch[:TOUCH_PAGES_MAX], time.monotonic()))
        except queue.Full:
            self._count(writes_dropped=1)
            return False
        self._count(writes_queued=1)
        return True

    def submit_blob(self, key: bytes, blob: bytes, on_error: Callable[[], None] | None = None) -> bool:
        """Queue one opaque value for L3 on the writer threads (never blocks). False:
        dropped (queue full or store down). `on_error` runs on the writer thread if the
        put raises. The value is stored as given (no copy); the caller must not mutate it."""
        if not self.available():
            self._count(blob_writes_dropped=1)
            return False
        try:
            self._writes.put_nowait(BlobJob(key, blob, on_error))
        except queue.Full:
            self._count(blob_writes_dropped=1)
            return False
        self._count(blob_writes_queued=1)
        return True

    def _write_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._writes.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(job, BlobJob):
                try:
                    self._write_blob(job)
                finally:
                    self._writes.task_done()
                continue
            stored = False
            try:
                stored = self._write(job)
            finally:
                self.host.finish_l3(job.keys, stored)
                self._writes.task_done()

    def _write_blob(self, job: BlobJob) -> None:
        if not self.available():
            self._count(blob_writes_dropped=1)
            return
        try:
            self.client.put(job.key, job.blob)  # values are write-once on the server
        except Exception as exc:  # noqa: BLE001 - best effort: the blob stays in the tiers above
            if isinstance(exc, (errors.GCacheError, OSError)):
                self._failed(exc)
            self._count(blob_write_errors=1)
            if job.on_error is not None:
                job.on_error()
            return
        self._answered()
        self._count(blob_write_bytes=len(job.blob))

    def _write(self, job: WriteJob) -> bool:
        """Store the job's pages; True if every value is in L3 afterwards."""
        if not self.available():
            self._count(writes_dropped=1)
            return False
        order = list(reversed(job.pages)) if self.config.protect_prefix else list(job.pages)
        keys, bufs, sizes = [], [], []
        for h, full, swa in order:  # slots captured at claim time: the pin keeps them this page's
            for kind, slot, pool in (
                (AttentionKind.FULL, full, AttentionKind.FULL),
                (AttentionKind.SWA, swa, AttentionKind.SWA),
            ):
                if slot is None:
                    continue
                keys.append(self.keys.key(h, pool))
                bufs.append(self._buffer(kind, slot))
                sizes.append(self.pool.page_bytes[kind])
        t0 = time.monotonic()
        try:
            ok = self.client.batch_put_from(keys, bufs, sizes=sizes)
            if self.config.protect_prefix and job.touch:
                # Both pools: a chain resumes only at a checkpoint whose SWA tail is there too
                # (the SWA keys that exist are its checkpoint tails; probing a missing key is free).
                self.client.batch_is_exist(
                    [self.keys.key(h, pool) for h in job.touch for pool in (AttentionKind.FULL, AttentionKind.SWA)]
                )
                self._count(touch_probes=1)
        except (errors.GCacheError, OSError) as exc:
            self._failed(exc)
            self._count(write_errors=1)
            return False
        self._answered()
        self._count(
            write_pages=len(order),
            write_bytes=sum(s for s, x in zip(sizes, ok) if x),
            write_seconds=time.monotonic() - t0,
        )
        return all(ok)

    def _buffer(self, kind: AttentionKind, slot: int):
        if not self.pool.page_bytes[kind]:
            return b""  # a model with no layers of this kind: empty values
        return self.pool.address(kind, slot)

    # ---- prefetch ------------------------------------------------------------------------
    def submit_prefetch(self, keys: list[str], start: int) -> Prefetch | None:
        """Start reading pages [start, len(keys)) of a chain into L2; None if the queue is
        full or the store is down (the request then simply misses L3)."""
        if not self.available() or start >= len(keys):
            return None
        p = Prefetch(keys[: start + PROBE_PAGES_MAX], start, time.monotonic())
        try:
            self._prefetches.put_nowait(p)
        except queue.Full:
            self._count(prefetch_dropped=1)
            return None
        self._count(prefetches=1)
        return p

    def release(self, p: Prefetch, cancelled: bool = False) -> None:
        """The request is done with the prefetch (admitted or gone): drop its pins. Safe
        to call while it is still running; the prefetch thread then unpins when done."""
        with p.lock:
            if p.released:
                return
            p.released = True
            if not p.done.is_set():
                if cancelled:
                    self._count(prefetch_cancelled=1)
                return
            pinned, p.pinned = p.pinned, []
        self.host.unpin(pinned)

    def _prefetch_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                p = self._prefetches.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                if p.released:
                    p.outcome = "cancelled"
                else:
                    self._prefetch(p)
                    if p.outcome != "failed":
                        self._answered()
            except (errors.GCacheError, OSError) as exc:
                self._failed(exc)
                p.outcome = "failed"
            finally:
                with p.lock:
                    p.done.set()
                    unpin = p.released
                    pinned = p.pinned if unpin else []
                    if unpin:
                        p.pinned = []
                if pinned:
                    self.host.unpin(pinned)
                self._count(**{f"prefetch_{p.outcome}": 1} if p.outcome in ("hit", "miss", "failed") else {})
                self._prefetches.task_done()

    def _prefetch(self, p: Prefetch) -> None:
        p.ready_end = p.start
        if not self.available():
            p.outcome = "failed"
            return
        chain = p.keys
        full_keys = [self.keys.key(h, AttentionKind.FULL) for h in chain[p.start :]]
        n_full = self.client.batch_exists_prefix(full_keys)  # also keeps the chain warm
        if n_full == 0:
            p.outcome = "miss"
            return
        swa_l3 = self.client.batch_is_exist(
            [self.keys.key(h, AttentionKind.SWA) for h in chain[p.start : p.start + n_full]]
        )
        in_l2 = {h: self.host.get(h) for h in chain[p.start : p.start + n_full]}

        def has_swa(i: int) -> bool:
            e = in_l2[chain[i]]
            return swa_l3[i - p.start] or (e is not None and e.swa is not None)

        end = last_safe_end(p.start, n_full, has_swa, self.page_size, self.window)
        if end == p.start:
            p.outcome = "miss"
            return
        while True:
            ready, cut = self._read(p, end, swa_l3, has_swa)
            earlier = last_safe_end(p.start, cut - p.start, has_swa, self.page_size, self.window)
            if ready > p.start or cut >= end or earlier == p.start:
                break
            end = earlier  # a bad page cut off end's window tail: read the checkpoint before it
        p.ready_end = ready
        p.outcome = "hit" if p.ready_end > p.start else "miss"

    def _read(self, p: Prefetch, end: int, swa_l3: list, has_swa) -> tuple[int, int]:
        """Read what L2 lacks of pages [start, end) into reserved slots, publish the good
        pages, keep pages [start, ready_end) pinned for the request; returns (ready_end,
        cut): cut < end is the first bad page (missing, wrong-sized or corrupt)."""
        chain, tail = p.keys, max(p.start, tail_start_page(end, self.page_size, self.window))
        pinned = self.host.pin(chain[p.start : end])  # what L2 has now stays until admission
        want = []  # (page index, kind)
        for i in range(p.start, end):
            e = self.host.get(chain[i])
            if e is None:
                want.append((i, AttentionKind.FULL))
            if i >= tail and (e is None or e.swa is None) and swa_l3[i - p.start]:
                want.append((i, AttentionKind.SWA))
        slots: dict[AttentionKind, list[int]] = {}
        for kind in (AttentionKind.FULL, AttentionKind.SWA):
            n = sum(1 for _, k in want if k == kind)
            got = self.host.reserve(kind, n) if n else []
            if got is None:  # L2 is pinned full: read nothing
                for k2, lst in slots.items():
                    self.host.cancel(k2, lst)
                self.host.unpin(pinned)
                return p.start, end
            slots[kind] = got
        it = {k: iter(v) for k, v in slots.items()}
        plan = [(i, kind, next(it[kind])) for i, kind in want]
        keys = [
            self.keys.key(chain[i], AttentionKind.FULL if kind == AttentionKind.FULL else AttentionKind.SWA)
            for i, kind, _ in plan
        ]
        bufs = [self._buffer(kind, s) if self.pool.page_bytes[kind] else bytearray(0) for _, kind, s in plan]
        sizes = [self.pool.page_bytes[kind] for _, kind, _ in plan]
        t0 = time.monotonic()
        try:
            got_lens = self.client.batch_get_into(keys, bufs, sizes=sizes) if plan else []
        except (errors.BufferTooSmallError, errors.ChecksumMismatchError) as exc:
            got_lens = exc.results  # None for those keys: bad pages (cut below), not a store failure
        except (errors.GCacheError, OSError):
            for kind, lst in slots.items():
                self.host.cancel(kind, lst)
            self.host.unpin(pinned)
            raise
        bad = {i for (i, kind, _), n in zip(plan, got_lens) if n != self.pool.page_bytes[kind]}
        self._count(
            read_pages=len(plan) - len(bad),
            read_bytes=sum(n for n in got_lens if n),
            read_bad_pages=len(bad),
            read_seconds=time.monotonic() - t0,
        )
        cut = min([end, *bad])  # a page missing or corrupt in the middle ends the chain there
        for i, kind, s in plan:
            if i >= cut:
                self.host.cancel(kind, [s])
                continue
            if self.host.publish(
                chain[i],
                s if kind == AttentionKind.FULL else None,
                s if kind == AttentionKind.SWA else None,
                origin=Tier.L3,
                in_l3=True,
                pin=kind == AttentionKind.FULL,
            ):
                p.fetched.add(chain[i])
                if kind == AttentionKind.FULL:
                    pinned.append(chain[i])
        # Pinned pages cannot be evicted (nor lose their SWA), so this is what the request gets.
        n, swa = self.host.run(chain, p.start)
        ready = last_safe_end(p.start, min(n, cut - p.start), lambda i: swa[i - p.start], self.page_size, self.window)
        keep = set(chain[p.start : ready])
        self.host.unpin([k for k in pinned if k not in keep])
        with p.lock:
            p.pinned = [k for k in pinned if k in keep]
        return ready, cut

    # ---- lifecycle -----------------------------------------------------------------------
    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait (bounded) until queued writes (pages and blobs) and prefetches are done."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._stopping.set()
        for t in self._threads:
            t.join(timeout=self.config.timeout_s * 3 + 1)
        for q in (self._writes, self._prefetches):  # drop what never ran, unpinning it
            while True:
                try:
                    job = q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, WriteJob):
                    self.host.finish_l3(job.keys, False)
                elif isinstance(job, Prefetch):
                    job.done.set()
                # a BlobJob holds nothing: dropping it is enough
        self.client.close()
