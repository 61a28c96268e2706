"""`gcache-router kv-events`: beside a vLLM OpenAI server, its KV events into the routers' Redis.

    vllm serve MODEL --port 8001 --kv-events-config \\
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/vllm-8001.kv"}'
    gcache-router kv-events --engine http://127.0.0.1:8001 --events ipc:///tmp/vllm-8001.kv \\
        --redis redis://127.0.0.1:6379/0 --block-size 16

(An ipc:// endpoint stays on the host; vLLM's `tcp://*:PORT` would listen on every interface.)

It subscribes to the engine's ZMQ event stream, turns BlockStored / BlockRemoved /
AllBlocksCleared into page flags under GCache's page ids (kv_events.py), and publishes them
to Redis exactly as a gcache-worker publishes its cache (gcache.serving.redis_layout: a
registration with a TTL heartbeat, a page hash, a delta stream), with an "engine" object
(engines.py) naming the server's models. Load (running, waiting) comes from the server's
/metrics. Routers read it like any worker's, so they stay stateless: a late or restarted
router rebuilds the same view from Redis, and any number of them agree.

Why beside the engine and not in the routers: a ZMQ stream has no history (a subscriber that
joins late or misses messages cannot rebuild what an engine holds; vLLM's replay buffer is
bounded), so state built in each router would differ from router to router and be lost with
it; here it is built once per engine, by one subscriber, and shared. The translator also
shares the engine's fate and host: it probes the engine, and the registration heartbeat it
keeps says "this engine is up and its events are flowing".

Several translators of one engine (every router's --vllm, or a sidecar beside them) agree by a
lease in Redis (P:lease:<url>, --ttl-s): its holder publishes, the others keep their state
warm and take over with a full snapshot when it goes.

Faults: the engine stops answering its /metrics for --engine-down-s -> deregistered at once
(routers stop sending there) and its state dropped; back -> registered again, learning from
its new events. Its events stop while it keeps taking prompts (it computed at least a block's
worth of prompt tokens and no event came for --events-stale-s) -> everything it was credited
with is dropped (it stays routable, by load: no stale hits). Redis down -> the next good
write is a full resync. The translator dies -> its registration expires after --ttl-s.
Malformed or hostile messages are dropped and counted (kv_events.py); the backlog is bounded
(ZMQ's receive high-water mark, then vLLM's PUB drops; the gap clears the state).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from gcache.router.ingest.kv_events import EngineEvents, Limits
from gcache.router.ingest.zmq_sub import subscribe_loop
from gcache.serving.announce.bridge import EventBridge
from gcache.serving.announce.engines import EngineInfo, EngineKind, with_info
from gcache.serving.announce.writer import AnnounceWriter
from gcache.serving.redis_client import fail_fast_redis
from gcache.serving.redis_layout import DEFAULT_PREFIX, Keys, Registration, WorkerLoad, valid_worker_url
from gcache.serving.safe_json import parse_json

log = logging.getLogger("gcache.router.ingest.kv_events")

METRICS_BYTES_MAX = 4 << 20
IDLE_S = 1.0  # token counters still this long: the engine runs nothing, whatever its gauges say
STALE_SETTLE_S = 2.0  # work the engine's /metrics shows within this of an event is that event's


@dataclass(frozen=True)
class TranslatorConfig:
    engine_url: str
    events: tuple[str, ...]
    redis_url: str
    prefix: str = DEFAULT_PREFIX
    topic: str = ""  # subscribe prefix ("" = every topic)
    bind: bool = False  # bind the SUB socket (vLLM's endpoint then connects to it)
    advertise_url: str = ""  # the URL routers use ("" = engine_url)
    models: tuple[str, ...] = ()  # () = the engine's /v1/models
    bucket: int | None = None
    l3: bool = False
    block_size: int = 16  # page size published before the first event says it
    interval_s: float = 0.1
    ttl_s: float = 3.0
    redis_timeout_s: float = 0.5
    probe_timeout_s: float = 1.0
    engine_down_s: float = 2.0
    events_stale_s: float = 10.0
    stream_max: int = 1000
    rcvhwm: int = 10_000  # ZMQ messages buffered for this subscriber (then vLLM's PUB drops)
    limits: Limits = Limits()
    lease: bool = True  # several translators of one engine (routers' --vllm, a sidecar): the lease holder publishes
    holder: str = ""  # this translator's lease identity ("" = random)

    def __post_init__(self) -> None:
        url = (self.advertise_url or self.engine_url).rstrip("/")
        if not valid_worker_url(self.engine_url.rstrip("/")) or not valid_worker_url(url):
            raise ValueError("--engine / --advertise-url must be http(s)://HOST:PORT")
        if not self.events:
            raise ValueError("give the engine's KV-event endpoint: --events ipc://PATH (or tcp://HOST:PORT)")
        for e in self.events:
            if not e.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--events must be a ZMQ endpoint (tcp://, ipc://), got {e!r}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("--redis must look like redis://HOST:PORT/DB")
        if not 0.01 <= self.interval_s <= 60 or self.ttl_s <= 2 * self.interval_s or self.ttl_s > 86400:
            raise ValueError("--interval-s in [0.01, 60], --ttl-s more than twice it")
        for name in ("redis_timeout_s", "probe_timeout_s", "engine_down_s", "events_stale_s"):
            if not 0 < getattr(self, name) <= 86400:
                raise ValueError(f"{name} must be in (0, 86400]")
        if not 1 <= self.block_size <= 1 << 14 or not 1 <= self.stream_max <= 1 << 26:
            raise ValueError("--block-size in [1, 16384], stream_max in [1, 2^26]")
        if not 1 <= self.rcvhwm <= 1 << 24:
            raise ValueError("--backlog in [1, 2^24]")

    @property
    def url(self) -> str:
        return (self.advertise_url or self.engine_url).rstrip("/")


# Take or renew the engine's publishing lease (KEYS[1]) for ARGV[1], PX ARGV[2]; 1 if held.
LEASE_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def parse_metrics(text: str) -> dict[str, float]:
    """Sums of the vLLM Prometheus samples the translator reads, over their label sets."""
    want = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
        "vllm:generation_tokens_total",
    )
    out = dict.fromkeys(want, 0.0)
    seen = set()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
                seen.add(name)
            except (ValueError, IndexError):
                continue
    if "vllm:num_requests_running" not in seen:
        raise ValueError("no vllm:num_requests_running in the engine's /metrics")
    return out


class Translator(EventBridge):
    """The events subscriber, the engine probe and the Redis publisher of one engine."""

    name = "kv-events"
    log = log

    def __init__(
        self, config: TranslatorConfig, clock: Callable[[], float] = time.monotonic, start_threads: bool = True
    ) -> None:
        self.config, self.clock = config, clock
        self.state = EngineEvents(config.limits)
        self.keys = Keys(config.prefix)
        self.redis, self._redis_errors = fail_fast_redis(config.redis_url, config.redis_timeout_s)
        self.writer = AnnounceWriter(
            self.redis, self.keys, config.url, ttl_s=config.ttl_s, stream_max=config.stream_max
        )
        self.models: tuple[str, ...] = config.models
        self.load = WorkerLoad()
        self._progress: tuple = ()
        self._progress_at = 0.0
        self.engine_up = False
        self._down_since: float | None = None
        self._registered = False
        self._page_size = config.block_size
        self._window = 1
        self._base: tuple[float, float] | None = None  # (computed prompt tokens, requests) at the last event
        self._pending_since: float | None = None
        self._probe_at: float | None = None
        self.counters = dict.fromkeys(
            (
                "flushes",
                "flush_errors",
                "resyncs",
                "probes",
                "probe_errors",
                "engine_down",
                "engine_up",
                "stale",
                "records_sent",
                "lease_changes",
            ),
            0,
        )
        self._down = False
        self.holder = config.holder or os.urandom(8).hex()
        self.leading = not config.lease  # publishes (a lone translator always does)
        self._start(config.interval_s, start_threads)

    # ---- the event stream (subscriber thread) ----------------------------------------------------
    def _sub_loop(self) -> None:
        c = self.config
        subscribe_loop(
            c.events,
            lambda frames, source: self.receive(frames, source),
            self._stop,
            topic=c.topic,
            bind=c.bind,
            rcvhwm=c.rcvhwm,
            max_bytes=c.limits.batch_bytes_max,
        )

    def receive(self, frames, source: int = 0) -> None:
        """One ZMQ message from the engine (also the tests' entry point)."""
        if isinstance(frames, (list, tuple)) and len(frames) == 3:
            frames = (bytes([source]) + bytes(frames[0]), frames[1], frames[2])  # sequence per endpoint
        self.state.apply_frame(frames, now=self.clock())

    # ---- the engine (publisher thread) ------------------------------------------------------------
    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(
            self.config.engine_url.rstrip("/") + path, timeout=self.config.probe_timeout_s
        ) as r:
            return r.read(METRICS_BYTES_MAX)

    def probe(self) -> bool:
        """Load and liveness from the engine's /metrics; the models once. False: it did not answer."""
        now = self.clock()
        self.counters["probes"] += 1
        try:
            m = parse_metrics(self._get("/metrics").decode("utf-8", "replace"))
            if not self.models:
                data = parse_json(self._get("/v1/models")).get("data")
                names = tuple(d["id"] for d in data if isinstance(d, dict) and isinstance(d.get("id"), str))
                if names:
                    self.models = names[:16]
        except (OSError, ValueError, urllib.error.URLError, KeyError, TypeError, AttributeError) as e:
            self.counters["probe_errors"] += 1
            if self._down_since is None:
                self._down_since = now
            if self.engine_up and now - self._down_since >= self.config.engine_down_s:
                log.warning("kv-events: engine %s not answering (%s); deregistering", self.config.engine_url, e)
                self.engine_up = False
                self.counters["engine_down"] += 1
                self.state.clear()
                self._base = self._pending_since = None
                if not self.config.models:
                    self.models = ()
            return False
        self._down_since = None
        if not self.engine_up:
            self.engine_up = True
            self.counters["engine_up"] += 1
            self._registered = False  # (re-)register with a full snapshot
        self.load = self._load(m, now)
        computed = m["vllm:prompt_tokens_total"] - m["vllm:prefix_cache_hits_total"]
        started = m["vllm:request_success_total"] + self.load.running + self.load.waiting  # (idle: gauges ignored)
        self._check_stale(computed, started, now)
        return True

    def _load(self, m: dict, now: float) -> WorkerLoad:
        """Running and waiting requests. vLLM sets these gauges from each engine step, so after
        its last step they keep the last values (an idle engine can show a request running
        forever): an engine whose token counters did not move for IDLE_S runs nothing."""
        progress = (m["vllm:prompt_tokens_total"], m["vllm:generation_tokens_total"], m["vllm:request_success_total"])
        if progress != self._progress:
            self._progress, self._progress_at = progress, now
        if now - self._progress_at >= IDLE_S:
            return WorkerLoad()
        return WorkerLoad(running=int(m["vllm:num_requests_running"]), waiting=int(m["vllm:num_requests_waiting"]))

    def _check_stale(self, computed: float, requests: float, now: float) -> None:
        """Since the last event the engine computed (not from its prefix cache) at least a
        block of prompt tokens per request it took, so at least one request filled a new block
        (hits are whole blocks: a request computing >= a block from one stores one), and no
        event came for events_stale_s: its stream stopped or its events are lost: drop its
        credit. Conservative: many requests that each compute less than a block owe nothing."""
        seen = self.state.last_event_at
        if self._base is None or (seen is not None and now - seen <= STALE_SETTLE_S):
            # an event came lately: the work counted so far is paid for (the engine's counters
            # may move a little after the events of the same step)
            self._base, self._pending_since = (computed, requests), None
            return
        owed = computed - self._base[0] >= self._page_size * max(1.0, requests - self._base[1])
        if not owed:
            return
        if self._pending_since is None:
            self._pending_since = now
        elif now - self._pending_since >= self.config.events_stale_s:
            if self.state.pages():
                log.warning(
                    "kv-events: no events from %s for %.0f s while it computes prompts; dropping its cache state",
                    self.config.engine_url,
                    now - self._pending_since,
                )
                self.counters["stale"] += 1
                self.state.clear()
            self._base, self._pending_since = (computed, requests), None

    # ---- Redis ----------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return EngineInfo(EngineKind.VLLM, self.models, self.config.bucket, self.config.l3)

    def flush(self) -> bool:
        """Probe the engine, then write what changed (or everything) to Redis; False if Redis failed.
        A translator that does not hold the engine's lease neither probes nor writes (its
        subscriber keeps its state warm for a takeover)."""
        try:
            if self.config.lease and not self._lease():
                return True
            up = (
                self.probe()
                if (self._probe_at is None or self.clock() - self._probe_at >= self.config.interval_s)
                else self.engine_up
            )
            self._probe_at = self.clock()
            if not up:
                if self._registered and not self.engine_up:
                    self.deregister()
                return True
            page_size, window = self.state.page_size or self.config.block_size, self.state.window
            if (page_size, window) != (self._page_size, self._window):
                self._page_size, self._window = page_size, window
                self._registered = False
            if not self._registered:
                self.state.failed(None)  # a full snapshot
            batch = self.state.take()
            try:
                if not self._write(batch) and not batch.full:
                    self.state.failed(batch)  # our registration was gone: rewrite everything
                    self._write(self.state.take())
            except BaseException:
                self.state.failed(batch)
                raise
        except self._redis_errors as e:
            self.counters["flush_errors"] += 1
            if not self._down:
                log.warning("kv-events: Redis write failed (%s); will resync when it is back", e)
            self._down = True
            return False
        if self._down:
            log.warning("kv-events: Redis is back; state resynced")
        self._down = False
        self.counters["flushes"] += 1
        return True

    def _write(self, batch) -> bool:
        """One MULTI (announce.writer); False if a delta found the registration gone."""
        model = self.models[0] if self.models else "vllm"

        def registration(epoch: str, seq: int, now_ms: int) -> bytes:
            reg = Registration(
                self.config.url,
                model,
                self._page_size,
                self._window,
                epoch,
                seq,
                now_ms,
                self.load,
                self.state.stats["dropped_dirty"],
            )
            return with_info(reg.to_json(), self.info(), {"translator": self.stats()})

        if not self.writer.write(batch.full, batch.pages, registration):
            return False
        if batch.full:
            self.counters["resyncs"] += 1
        self.counters["records_sent"] += len(batch.pages)
        self._registered = True
        return True

    def _lease(self) -> bool:
        """Hold the engine's publishing lease (P:lease:<url>, expiring after ttl_s): only its
        holder writes, so the translators of every router agree on one epoch; the others keep
        their state current and take over (with a full snapshot) when the holder goes."""
        key = f"{self.keys.prefix}:lease:{self.config.url}"
        held = bool(self.redis.eval(LEASE_SCRIPT, 1, key, self.holder, int(self.config.ttl_s * 1000)))
        if held != self.leading:
            self.counters["lease_changes"] += 1
        self.leading = held
        if not held:
            self._registered = False  # a takeover writes everything
        return held

    def deregister(self) -> None:
        """Remove the engine from Redis: routers stop sending to it at once."""
        self.writer.deregister()
        self._registered = False

    def stats(self) -> dict:
        return {**self.counters, **{f"events_{k}": v for k, v in self.state.stats.items()}, "pages": self.state.pages()}

    @property
    def source(self) -> str:
        return self.config.url

    def stop(self, deregister: bool = True) -> None:
        self._join()
        if deregister:
            try:
                if self.config.lease:
                    # Hand the engine over: another translator of it (another router's) takes the
                    # lease and rewrites its state; with none, its registration expires (ttl_s).
                    if self.leading:
                        self.redis.eval(RELEASE_SCRIPT, 1, f"{self.keys.prefix}:lease:{self.config.url}", self.holder)
                else:
                    self.deregister()
            except self._redis_errors as e:
                log.warning("kv-events: could not deregister %s (%s)", self.config.url, e)
        self.redis.close()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="gcache-router kv-events",
        description="Publish a vLLM server's KV events (ZMQ) to the routers' Redis, as a gcache-worker publishes its cache",
    )
    ap.add_argument("--engine", required=True, metavar="URL", help="the vLLM OpenAI server, http://HOST:PORT")
    ap.add_argument(
        "--events",
        required=True,
        action="append",
        metavar="ENDPOINT",
        help="its --kv-events-config endpoint to subscribe to (ipc://PATH, tcp://HOST:PORT); one per "
        "data-parallel rank",
    )
    ap.add_argument("--redis", required=True, metavar="redis://HOST:PORT/DB")
    ap.add_argument("--redis-prefix", default=DEFAULT_PREFIX)
    ap.add_argument("--topic", default="", help="subscribe to this topic prefix (default: every topic)")
    ap.add_argument("--bind", action="store_true", help="bind the endpoint (the engine's publisher connects)")
    ap.add_argument("--advertise-url", default="", help="the URL routers send requests to (default: --engine)")
    ap.add_argument("--model", action="append", default=[], help="served model name(s) (default: its /v1/models)")
    ap.add_argument(
        "--bucket", type=int, default=None, help="the router's --length-buckets group it serves (0 = shortest)"
    )
    ap.add_argument("--l3", action="store_true", help="it runs the GCache connector (loads the shared L3)")
    ap.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="the engine's --block-size: the page size its registration carries until its first event says",
    )
    ap.add_argument("--interval-s", type=float, default=0.1, help="publish and probe period")
    ap.add_argument("--ttl-s", type=float, default=3.0, help="registration TTL (the translator's heartbeat)")
    ap.add_argument("--engine-down-s", type=float, default=2.0, help="engine silent this long -> deregistered")
    ap.add_argument(
        "--events-stale-s", type=float, default=10.0, help="no events this long while it computes -> state dropped"
    )
    ap.add_argument("--backlog", type=int, default=10_000, help="event messages buffered (ZMQ high-water mark)")
    ap.add_argument("--pages-max", type=int, default=Limits.pages_max, help="blocks tracked (oldest dropped beyond)")
    ap.add_argument(
        "--l3-events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="also subscribe to the GCache connectors' L3 events (gcache_kv_events_endpoint; repeatable: give "
        "every connector's, the L3 is one namespace) and write them into --redis's shared L3 view "
        "(docs/kv-events.md)",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import zmq  # noqa: F401  (pyzmq: installed with vLLM)
    except ImportError:
        print("gcache-router kv-events: needs pyzmq (pip install pyzmq)", file=sys.stderr)
        return 2
    try:
        cfg = TranslatorConfig(
            engine_url=args.engine,
            events=tuple(args.events),
            redis_url=args.redis,
            prefix=args.redis_prefix,
            topic=args.topic,
            bind=args.bind,
            advertise_url=args.advertise_url,
            models=tuple(args.model),
            bucket=args.bucket,
            l3=args.l3,
            block_size=args.block_size,
            interval_s=args.interval_s,
            ttl_s=args.ttl_s,
            engine_down_s=args.engine_down_s,
            events_stale_s=args.events_stale_s,
            rcvhwm=args.backlog,
            limits=Limits(pages_max=args.pages_max),
        )
    except ValueError as e:
        print(f"gcache-router kv-events: {e}", file=sys.stderr)
        return 2
    l3 = None
    if args.l3_events:
        from gcache.router.ingest.l3_events import L3EventsConfig, L3Subscriber

        try:
            l3_cfg = L3EventsConfig(
                endpoints=tuple(x.strip() for item in args.l3_events for x in item.split(",") if x.strip()),
                redis_url=args.redis,
                prefix=args.redis_prefix,
            )
        except ValueError as e:
            print(f"gcache-router kv-events: {e}", file=sys.stderr)
            return 2
        l3 = L3Subscriber(l3_cfg)
    tr = Translator(cfg)
    print(
        f"gcache-router kv-events: {cfg.engine_url} events {','.join(cfg.events)} -> {cfg.redis_url} as {cfg.url}",
        flush=True,
    )
    stop = threading.Event()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        tr.stop()
        if l3 is not None:
            l3.stop()
    return 0
