"""The worker's side of routing: registration (TTL heartbeat), cache events and load, to Redis.

The engine thread only runs `on_step` (a step hook): the first call attaches the cache
observers (cache_events.py) and snapshots the cache; later calls sample the load every
interval_s. The announce bridge's flush thread (direct mode: gcache.serving.announce.bridge)
runs `flush()`: one MULTI per flush, written by the one writer (announce.writer), holds the
page changes (hash + stream entry), the registration with its TTL and the L3 reports (layout
in gcache/serving/redis_layout.py). Redis down or slow never blocks the engine: only flush()
talks to Redis, with a timeout, and after a failure the next good flush is a full resync
(Redis may have restarted empty); meanwhile the event buffer stays bounded (drop + count +
resync).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gcache.serving.announce.bridge import EventBridge
from gcache.serving.announce.writer import AnnounceWriter
from gcache.serving.redis_client import fail_fast_redis
from gcache.serving.redis_layout import DEFAULT_PREFIX, Keys, Registration, WorkerLoad, valid_worker_url
from gcache.worker.kvcache.cache_events import CacheEventLog

log = logging.getLogger("gcache.worker.http.publisher")


@dataclass(frozen=True)
class PublisherConfig:
    redis_url: str
    advertise_url: str
    prefix: str = DEFAULT_PREFIX
    interval_s: float = 0.1  # flush / load-sample period (0: sample load at every on_step)
    ttl_s: float = 3.0  # registration TTL: a dead worker disappears after this
    events_max: int = 16384  # dirty pages buffered between flushes (then: drop + resync)
    stream_max: int = 1000  # event stream entries kept (MAXLEN ~); a router further
    #                                  behind reloads the snapshot. Bytes <= 9 * events_max each.
    resync_interval_s: float = 300.0  # rebuild the mirror from the real cache this often
    redis_timeout_s: float = 0.5
    l3_pages_max: int = 1 << 20  # cap of the shared L3 index in Redis
    model: str = ""
    role: str = "mixed"  # handoff.Role, published in the registration

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis must look like redis://HOST:PORT/DB, got {self.redis_url!r}")
        if not valid_worker_url(self.advertise_url.rstrip("/")):
            raise ValueError(
                "--advertise-url must be http(s)://HOST:PORT (printable, no spaces or quotes), "
                f"got {self.advertise_url[:200]!r}"
            )
        if not 0 <= self.interval_s <= 60:
            raise ValueError("publish interval must be in [0, 60] s")
        if not 0.1 <= self.ttl_s <= 86400 or self.ttl_s <= 2 * self.interval_s:
            raise ValueError("publish ttl must be in [0.1, 86400] s and more than twice the interval")
        if not 0 < self.redis_timeout_s <= 60 or not 0 < self.resync_interval_s <= 86400:
            raise ValueError("redis_timeout_s must be in (0, 60], resync_interval_s in (0, 86400]")
        for name in ("events_max", "stream_max", "l3_pages_max"):
            if not 1 <= getattr(self, name) <= 1 << 26:
                raise ValueError(f"{name} must be in [1, 2^26]")


class WorkerPublisher(EventBridge):
    """The worker's cache and load, announced to the routers (the bridge's direct mode)."""

    name = "router-publisher"
    log = log

    def __init__(
        self, engine, config: PublisherConfig, start_thread: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config, self.clock = config, clock
        self.url = config.advertise_url.rstrip("/")
        self.keys = Keys(config.prefix)
        self.events = CacheEventLog(config.events_max)
        self.page_size, self.window = engine.page_size, engine.window
        self.model = config.model or engine.cache.key_model() or "model"
        self.redis, self._redis_errors = fail_fast_redis(config.redis_url, config.redis_timeout_s)
        self.writer = AnnounceWriter(
            self.redis,
            self.keys,
            self.url,
            ttl_s=config.ttl_s,
            stream_max=config.stream_max,
            l3_pages_max=config.l3_pages_max,
        )
        self._attached = False
        self._load = WorkerLoad()
        self._load_at: float | None = None
        self._rebuilt_at = clock()
        self._flush_lock = threading.Lock()
        self._down = False
        self.counters = dict.fromkeys(("flushes", "flush_errors", "flush_crashes", "resyncs", "records_sent"), 0)
        self._start(config.interval_s, start_thread, subscribe=False)

    # ---- engine thread ---------------------------------------------------------------------------
    def on_step(self, engine) -> None:
        """The step hook: cheap; never touches Redis."""
        now = self.clock()
        if not self._attached:
            self.events.attach(engine.cache)
            self._attached = True
        elif now - self._rebuilt_at >= self.config.resync_interval_s:
            self.events.rebuild()
            self._rebuilt_at = now
        if self._load_at is None or now - self._load_at >= self.config.interval_s:
            self._load = sample_load(engine)
            self._load_at = now

    # ---- publisher thread (or a bench, synchronously) ----------------------------------------------
    def flush(self) -> bool:
        """Write what was collected (or a full resync) to Redis; False if Redis failed."""
        with self._flush_lock:
            if not self._attached:
                return True  # nothing observed yet: registering an unknown cache would mislead routers
            batch = self.events.take()
            try:
                if not self._write(batch):
                    # Our registration was gone (Redis restarted empty, or we stalled past the
                    # TTL): what the delta assumed is not there; rewrite everything now.
                    self.events.failed(batch)
                    batch = self.events.take()
                    self._write(batch)
            except self._redis_errors as e:
                self.events.failed(batch)
                self.counters["flush_errors"] += 1
                if not self._down:
                    log.warning("publisher: Redis write failed (%s); will resync when it is back", e)
                self._down = True
                return False
            except BaseException:
                self.events.failed(batch)  # whatever happened, the next flush resends everything
                raise
            if self._down:
                log.warning("publisher: Redis is back; state resynced")
            self._down = False
            self.counters["flushes"] += 1
            self.counters["records_sent"] += len(batch.pages)
            return True

    def _write(self, batch) -> bool:
        """One MULTI (announce.writer); False if a delta found our registration gone."""

        def registration(epoch: str, seq: int, now_ms: int) -> bytes:
            reg = Registration(
                self.url,
                self.model,
                self.page_size,
                self.window,
                epoch,
                seq,
                now_ms,
                self._load,
                self.events.stats["dropped"],
                self.config.role,
            )
            return reg.to_json()

        if not self.writer.write(batch.full, batch.pages, registration, batch.l3):  # its L3 writes: adds only
            return False
        if batch.full:
            self.counters["resyncs"] += 1
        return True

    # ---- shutdown ------------------------------------------------------------------------------------
    def stop(self, deregister: bool = True) -> None:
        """Stop the thread, stop observing, and (by default) remove this worker from Redis so
        routers stop sending to it at once. Bounded by the Redis timeout; errors are ignored."""
        self._join(timeout_s=5 * self.config.redis_timeout_s + 1)
        self.events.detach()
        if deregister:
            try:
                self.writer.deregister()
            except self._redis_errors as e:
                log.warning("publisher: could not deregister %s (%s)", self.url, e)
        self.redis.close()

    @property
    def source(self) -> str:
        return self.url

    def stats(self) -> dict:
        """Counters: flushes, errors, resyncs, records sent, events seen / dropped, pending."""
        return {
            **self.counters,
            **{f"events_{k}": v for k, v in self.events.stats.items()},
            "pending": self.events.pending(),
        }


def sample_load(engine) -> WorkerLoad:
    """Running / waiting requests, prompt tokens still to compute, tokens held by running ones."""
    sched = engine.scheduler
    running, waiting = list(engine.batcher.running), list(sched.waiting)
    queued = sum(r.uncached_estimate for r in waiting)
    queued += sum(r.to_compute for r in running if not r.is_decoding)
    active = sum(r.num_tokens for r in running)
    free = engine.kv.full.num_free + engine.cache.cached_pages()[0]  # the cache's pages are evictable (at most)
    return WorkerLoad(len(running), len(waiting), int(queued), int(active), sched.config.max_running, int(free))


def add_publisher_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("routing (publish cache state and load for gcache-router)")
    g.add_argument(
        "--redis",
        default="",
        metavar="redis://HOST:PORT/DB",
        help="publish this worker's cache and load to this Redis for gcache-router",
    )
    g.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="namespace of the Redis keys (as the routers)")
    g.add_argument(
        "--advertise-url", default="", help="the URL routers use to reach this worker (default http://HOST:PORT)"
    )
    g.add_argument("--publish-interval-s", type=float, default=0.1)
    g.add_argument(
        "--publish-ttl-s",
        type=float,
        default=3.0,
        help="registration TTL: a worker that stops publishing leaves routing after this",
    )


def start_publisher(args: argparse.Namespace, engine_thread, bound_port: int | None = None) -> WorkerPublisher | None:
    """From the worker's flags: None without --redis; else a running publisher whose step hook
    is registered on the engine thread. `bound_port`: the port actually bound (for --port 0).
    ValueError for bad flags."""
    if not getattr(args, "redis", ""):
        return None
    url = args.advertise_url
    if not url:
        if args.host in ("0.0.0.0", "::", ""):
            raise ValueError("--advertise-url is needed when listening on all interfaces")
        url = f"http://{args.host}:{bound_port if bound_port is not None else args.port}"
    cfg = PublisherConfig(
        redis_url=args.redis,
        advertise_url=url,
        prefix=args.redis_prefix,
        interval_s=args.publish_interval_s,
        ttl_s=args.publish_ttl_s,
        model=getattr(args, "model_name", "") or "",
        role=getattr(args, "role", "mixed"),
    )
    pub = WorkerPublisher(engine_thread.engine, cfg, start_thread=True)
    engine_thread.add_step_hook(pub.on_step)
    return pub
