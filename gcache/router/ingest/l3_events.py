"""GCache's L3 events (its vLLM connectors', docs/kv-events.md) into the routers' shared L3 view.

    gcache-router --redis redis://... --l3-events ipc:///tmp/gcache-l3-a.kv --l3-events ipc:///tmp/gcache-l3-b.kv
    gcache-router kv-events --engine ... --events ... --redis ... --l3-events ipc:///tmp/gcache-l3-a.kv

(ipc:// when the engines share the router's host; tcp://HOST:PORT to reach another host.)

With vLLM engines only (no gcache-worker writes P:l3), this is what tells routers what the L3
holds, so `cache_aware`'s tier weights credit L3 on servers registered with --l3. Each
endpoint (one connector) is translated by its own kv_events.EngineEvents in shared-L3 mode
(medium GCACHE -> L3_FULL / L3_SWA, page ids re-chained from the events' token ids, exactly
as an engine's own events), all of them over ONE kv_events.Chain: the L3 is one namespace, so
a page engine B stores on a prefix engine A announced (B loaded it from the L3) is named
from A's announcement, not dropped as an orphan (arriving before A's, it waits for it:
kv_events.Chain.park). The union over the connectors is written
through the one writer (gcache.serving.announce.writer), adds and removals, so a page some
connector withdraws leaves the view only when no other connector still announces it.

Faults: a malformed frame, batch or event is dropped and counted (EngineEvents); a sequence
gap or restart clears that connector's part (it may have missed removals); Redis down -> the
next good write rewrites the whole union; bounded by each EngineEvents' limits and
l3_pages_max in Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gcache.router.ingest.kv_events import Chain, EngineEvents, Limits
from gcache.router.ingest.zmq_sub import subscribe_loop
from gcache.serving.announce.bridge import EventBridge
from gcache.serving.announce.writer import AnnounceWriter
from gcache.serving.redis_client import fail_fast_redis
from gcache.serving.redis_layout import DEFAULT_PREFIX, Keys

log = logging.getLogger("gcache.router.ingest.l3_events")

PARKED_MAX = 4096  # stores waiting for another connector's event to name their parent


@dataclass(frozen=True)
class L3EventsConfig:
    endpoints: tuple[str, ...]
    redis_url: str
    prefix: str = DEFAULT_PREFIX
    page_size: int | None = None  # events of another block size are not counted (None: the first event's)
    topic: str = ""  # subscribe prefix ("" = every topic)
    interval_s: float = 0.1
    redis_timeout_s: float = 0.5
    l3_pages_max: int = 1 << 20  # cap of each L3 set in Redis
    rcvhwm: int = 10_000
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("--l3-events needs at least one endpoint")
        for e in self.endpoints:
            if not e.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--l3-events must be a ZMQ endpoint (ipc://PATH, tcp://HOST:PORT), got {e!r}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("--l3-events needs --redis redis://HOST:PORT/DB")
        if not 1 <= (self.page_size or 1) <= 1 << 14 or not 0.01 <= self.interval_s <= 60:
            raise ValueError("page size in [1, 16384], interval in [0.01, 60] s")
        if not 1 <= self.l3_pages_max <= 1 << 26 or not 1 <= self.rcvhwm <= 1 << 24:
            raise ValueError("l3_pages_max in [1, 2^26], rcvhwm in [1, 2^24]")


class L3Union:
    """Several connectors' L3 views -> what to add to and remove from the shared one."""

    def __init__(self, sources: list[EngineEvents]) -> None:
        self.sources = sources
        self.mirrors: list[dict[int, int]] = [{} for _ in sources]  # what each source credits
        self.written: dict[int, int] = {}  # the union as last written to Redis
        self.rewrite = True  # the next changes() rewrites the whole union

    def changes(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(adds, removals); the caller calls done() once Redis has them, or
        failed() (then everything is written again)."""
        touched: set[int] = set()
        for src, mirror in zip(self.sources, self.mirrors):
            batch = src.take()
            if batch.full:
                touched.update(mirror)
                mirror.clear()
            for pid, f in batch.pages:
                touched.add(pid)
                if f:
                    mirror[pid] = f
                else:
                    mirror.pop(pid, None)
        if self.rewrite:
            touched.update(self.written)
            for mirror in self.mirrors:
                touched.update(mirror)
        adds, removes = [], []
        for pid in touched:
            now = 0
            for mirror in self.mirrors:
                now |= mirror.get(pid, 0)
            old = self.written.get(pid, 0)
            if now and (self.rewrite or now & ~old):
                adds.append((pid, now))
            if old & ~now:
                removes.append((pid, old & ~now))
        return adds, removes

    def done(self, adds: list[tuple[int, int]], removes: list[tuple[int, int]]) -> None:
        for pid, f in adds:
            self.written[pid] = f
        for pid, f in removes:
            left = self.written.get(pid, 0) & ~f
            if left:
                self.written[pid] = left
            else:
                self.written.pop(pid, None)
        self.rewrite = False

    def failed(self) -> None:
        """Redis did not take them: the mirrors stay (they are the sources' truth); rewrite all."""
        self.rewrite = True


class L3Subscriber(EventBridge):
    """The connectors' L3 events (one EngineEvents per endpoint) into the shared L3 view in Redis."""

    name = "l3-events"
    log = log

    def __init__(
        self, config: L3EventsConfig, clock: Callable[[], float] = time.monotonic, start_threads: bool = True
    ) -> None:
        self.config, self.clock = config, clock
        self.keys = Keys(config.prefix)
        # one chain namespace for every connector; a store may wait for another's event
        self.chain = Chain(config.limits.chain_max, parked_max=PARKED_MAX)
        self.sources = [EngineEvents(config.limits, shared_l3=True, chain=self.chain) for _ in config.endpoints]
        for src in self.sources:
            src.page_size = config.page_size  # None: learnt from the first full-attention event
        self.union = L3Union(self.sources)
        self.redis, self._redis_errors = fail_fast_redis(config.redis_url, config.redis_timeout_s)
        self.writer = AnnounceWriter(self.redis, self.keys, "", l3_pages_max=config.l3_pages_max)  # the L3 view only
        self.counters = dict.fromkeys(("flushes", "flush_errors", "added", "removed", "rewrites"), 0)
        self._lock = threading.Lock()  # flush() from the thread or a test
        self._down = False
        self._start(config.interval_s, start_threads)

    def _sub_loop(self) -> None:
        c = self.config
        subscribe_loop(
            c.endpoints,
            self.receive,
            self._stop,
            topic=c.topic,
            rcvhwm=c.rcvhwm,
            max_bytes=c.limits.batch_bytes_max,
        )

    def receive(self, frames, source: int = 0) -> None:
        """One ZMQ message from connector `source` (also the tests' entry point). Never raises."""
        self.sources[source].apply_frame(frames, now=self.clock())

    def flush(self) -> bool:
        """Write what changed (or everything, after a failure); False if Redis failed."""
        with self.chain.lock:
            self.chain.settle(self.clock())  # parked stores that waited out: orphans
        with self._lock:
            rewrite = self.union.rewrite
            adds, removes = self.union.changes()
            if not adds and not removes:
                if rewrite:
                    self.union.done([], [])
                return True
            try:
                self.writer.write_l3(adds, removes)
            except self._redis_errors as e:
                self.union.failed()
                self.counters["flush_errors"] += 1
                if not self._down:
                    log.warning("l3-events: Redis write failed (%s); will rewrite the L3 view when it is back", e)
                self._down = True
                return False
            self.union.done(adds, removes)
            if self._down:
                log.warning("l3-events: Redis is back; L3 view rewritten")
            self._down = False
            self.counters["flushes"] += 1
            self.counters["rewrites"] += int(rewrite)
            self.counters["added"] += len(adds)
            self.counters["removed"] += len(removes)
            return True

    def stats(self) -> dict:
        out: dict = dict(self.counters)
        for i, src in enumerate(self.sources):
            for k, v in src.stats.items():
                out[f"events_{k}"] = out.get(f"events_{k}", 0) + v
            out[f"pages_{i}"] = src.pages()
        out["pages"] = len(self.union.written)
        out["parked"] = len(self.chain.parked)
        return out

    @property
    def source(self) -> str:
        return ",".join(self.config.endpoints)

    def stop(self) -> None:
        self._join()
        self.redis.close()
