"""`gcache-worker`: OpenAI-style completions over HTTP in front of one Engine.

The engine runs alone in its loop thread; HTTP handler threads parse and check a request,
put it in a bounded inbox and wait (bounded) for the engine thread to finish it.
Endpoints: POST /v1/completions, GET /health, GET /metrics (Prometheus), GET /v1/models.
"""
from __future__ import annotations

import argparse
import json
import queue
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gcache.errors import GCacheError

from .completions import CompletionError, build_response, parse_completion
from .config import ModelConfig
from .engine import Engine, EngineConfig
from .hicache_config import PREFETCH_POLICIES, WRITE_POLICIES, HiCacheConfig
from .kv_pool import DualKVCache
from .request import FINISH_ABORT, Request
from .scheduler import QueueFullError, SchedulerConfig
from .tokenizer import ByteTokenizer

BODY_BYTES_MAX = 8 << 20


class Pending:
    """A submission travelling from a handler thread to the engine thread and back."""

    def __init__(self, prompt: list[int], params, ) -> None:
        self.prompt, self.params = prompt, params
        self.done = threading.Event()
        self.request: Request | None = None
        self.error: Exception | None = None


class EngineThread(threading.Thread):
    """Owns the engine: drains the inbox, steps while there is work, wakes the waiters."""

    def __init__(self, engine: Engine, inbox_max: int, integrity_check_s: float = 5.0) -> None:
        super().__init__(name="engine-loop", daemon=True)
        self.engine = engine
        self.integrity_check_s = integrity_check_s
        self._last_check = time.monotonic()
        self.inbox: queue.Queue[Pending] = queue.Queue(maxsize=inbox_max)
        self.waiters: dict[int, Pending] = {}
        self.stopping = threading.Event()
        self.failure: BaseException | None = None

    def submit(self, p: Pending) -> None:
        if self.stopping.is_set() or not self.is_alive():
            raise QueueFullError("engine is not running")
        try:
            self.inbox.put_nowait(p)
        except queue.Full:
            raise QueueFullError("inbox is full") from None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._drain_inbox(block=not self.engine.has_work())
                if self.engine.has_work():
                    for r in self.engine.step():
                        self._wake(r)
                    if not self.engine.last_step_ran:
                        time.sleep(0.001)  # waiting requests wait on L3 prefetches
                elif self.integrity_check_s and time.monotonic() - self._last_check >= self.integrity_check_s:
                    self.engine.check_integrity()  # idle: an IntegrityError stops the worker loudly
                    self._last_check = time.monotonic()
        except BaseException as e:  # crash loudly, but never leave a waiter hanging
            self.failure = e
            raise
        finally:
            self.stopping.set()
            for r in self.engine.abort_all():
                self._wake(r)
            self._drain_inbox(block=False)

    def _drain_inbox(self, block: bool) -> None:
        for i in range(self.inbox.maxsize):
            try:
                p = self.inbox.get(timeout=0.05) if block and i == 0 else self.inbox.get_nowait()
            except queue.Empty:
                return
            if self.stopping.is_set():
                p.error = QueueFullError("engine is stopping")
                p.done.set()
                continue
            try:
                p.request = self.engine.add_request(p.prompt, p.params)
                self.waiters[p.request.rid] = p
            except (ValueError, QueueFullError) as e:
                p.error = e
                p.done.set()

    def _wake(self, r: Request) -> None:
        p = self.waiters.pop(r.rid, None)
        if p is not None:
            p.done.set()


class Handler(BaseHTTPRequestHandler):
    server_version = "gcache-worker/0.1"
    protocol_version = "HTTP/1.1"

    # set on the class by make_server
    engine_thread: EngineThread
    tokenizer: ByteTokenizer
    model_name: str
    request_timeout_s: float
    slots: threading.BoundedSemaphore

    def log_message(self, fmt, *args) -> None:  # quiet: one line per error only
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self) -> None:
        eng = self.engine_thread.engine
        if self.path == "/health":
            ok = self.engine_thread.is_alive() and not self.engine_thread.stopping.is_set()
            snap = eng.metrics.snapshot()
            self._json(200 if ok else 503, {"status": "ok" if ok else "down",
                                            "waiting": snap["waiting_requests"],
                                            "running": snap["running_requests"]})
        elif self.path == "/metrics":
            self._send(200, eng.metrics.render().encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]})
        else:
            self._error(404, f"no such endpoint: GET {self.path}", "not_found")

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._error(404, f"no such endpoint: POST {self.path}", "not_found")
            return
        if not self.slots.acquire(blocking=False):
            self._error(503, "too many requests in flight; retry later", "overloaded")
            return
        try:
            self._complete()
        finally:
            self.slots.release()

    def _read_body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._error(411, "a Content-Length header is required")
            return None
        if int(length) > BODY_BYTES_MAX:
            self._error(413, f"body of {length} bytes exceeds the limit of {BODY_BYTES_MAX}")
            self.close_connection = True
            return None
        return self.rfile.read(int(length))

    def _complete(self) -> None:
        body = self._read_body()
        if body is None:
            return
        try:
            prompt, params = parse_completion(body, self.tokenizer)
        except CompletionError as e:
            self._error(400, str(e))
            return
        p = Pending(prompt, params)
        try:
            self.engine_thread.submit(p)
        except QueueFullError as e:
            self._error(503, f"server busy: {e}", "overloaded")
            return
        if not p.done.wait(self.request_timeout_s):
            self._error(504, f"request did not finish within {self.request_timeout_s} s", "timeout")
            return
        if p.error is not None:
            status = 503 if isinstance(p.error, QueueFullError) else 400
            self._error(status, str(p.error), "overloaded" if status == 503 else "invalid_request_error")
            return
        r = p.request
        if r.finish_reason == FINISH_ABORT:
            self._error(503, f"request aborted: {r.error}", "overloaded")
            return
        self._json(200, build_response(r, self.tokenizer, self.model_name))


def build_engine(args: argparse.Namespace) -> tuple[Engine, str]:
    from . import backend
    from .model import Model
    from .weights import load

    weights = None
    if args.weights:
        cfg, weights = load(args.weights)
    else:
        overrides = json.loads(args.config_json) if args.config_json else {}
        base = ModelConfig.large if args.preset == "large" else ModelConfig.small
        cfg = base(**overrides)
    if args.dtype:
        cfg = cfg.with_dtype(args.dtype)
    xp = backend.select_backend()
    model = Model(cfg, weights, xp)
    kv = DualKVCache.from_budget(cfg, int(args.kv_budget_mib * (1 << 20)), args.swa_full_ratio, xp)
    sched = SchedulerConfig(policy=args.policy, max_waiting=args.max_waiting, max_running=args.max_running,
                            max_tokens_per_step=args.max_tokens_per_step, chunk_tokens=args.chunk_tokens)
    name = args.model_name or f"gcache-hybrid-{cfg.layers}l-{cfg.hidden}h"
    hicache = HiCacheConfig(
        l2_bytes=int(args.l2_mib * (1 << 20)), l2_swa_full_ratio=args.l2_swa_full_ratio, l3_url=args.l3,
        model_name=name, write_policy=args.write_policy, write_threshold=args.write_threshold,
        prefetch_policy=args.prefetch_policy, prefetch_timeout_s=args.prefetch_timeout_s,
        swa_checkpoint_pages=args.swa_checkpoint_pages, layerwise_load=not args.no_layerwise_load,
        l3_timeout_s=args.l3_timeout_s)
    econf = EngineConfig(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                         prefix_cache=not args.no_prefix_cache, scheduler=sched, hicache=hicache)
    return Engine(model, kv, econf), name


def make_server(engine: Engine, host: str, port: int, model_name: str, request_timeout_s: float = 600.0,
                max_in_flight: int = 256, integrity_check_s: float = 5.0) -> tuple[ThreadingHTTPServer, EngineThread]:
    loop = EngineThread(engine, inbox_max=max(1, max_in_flight), integrity_check_s=integrity_check_s)
    handler = type("BoundHandler", (Handler,), {
        "engine_thread": loop, "tokenizer": ByteTokenizer(engine.vocab_size), "model_name": model_name,
        "request_timeout_s": request_timeout_s, "slots": threading.BoundedSemaphore(max_in_flight)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server, loop


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gcache-worker", description="Hybrid-SWA inference worker (HTTP)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--preset", choices=("small", "large"), default="small")
    ap.add_argument("--config-json", default="", help='ModelConfig overrides, e.g. \'{"layers": 4}\'')
    ap.add_argument("--weights", default="", help=".npz or .safetensors (config read from the file)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="")
    ap.add_argument("--model-name", default="")
    ap.add_argument("--kv-budget-mib", type=float, default=64.0)
    ap.add_argument("--swa-full-ratio", type=float, default=0.5, help="SWA pages per full page")
    ap.add_argument("--policy", choices=("ttft", "fcfs"), default="ttft")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--max-waiting", type=int, default=1024)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--max-in-flight", type=int, default=256, help="concurrent HTTP completions")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--integrity-check-s", type=float, default=5.0,
                    help="when idle, check every cache invariant this often (0 = never)")
    h = ap.add_argument_group("cache hierarchy (L1 device / L2 host / L3 GCache)")
    h.add_argument("--l2-mib", type=float, default=0.0,
                   help="host-memory KV pool (L2), MiB; pages evicted from the device go here (0 = no L2)")
    h.add_argument("--l2-swa-full-ratio", type=float, default=0.25,
                   help="SWA slots per full slot in L2 (L2 keeps SWA only at checkpoints)")
    h.add_argument("--l3", default="", metavar="URL",
                   help="GCache as L3: host:port of one gcache-server or gcache://m1:p,... for a cluster "
                        "(needs --l2-mib); pages are keyed by --model-name, so workers of one model share them")
    h.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through",
                   help="write_through: cached pages go to L2/L3 at once; write_through_selective: once hit "
                        "--write-threshold times; write_back: when evicted from the device")
    h.add_argument("--write-threshold", type=int, default=2, help="hits before write_through_selective writes a page")
    h.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="timeout",
                   help="a queued request prefetches from L3 while it waits; best_effort: admit it whenever "
                        "it is its turn; wait_complete: not before the prefetch is done; timeout: wait at "
                        "most --prefetch-timeout-s")
    h.add_argument("--prefetch-timeout-s", type=float, default=0.5)
    h.add_argument("--swa-checkpoint-pages", type=int, default=0,
                   help="also keep SWA KV for the window before every N pages (0: only at request ends "
                        "and branch points); more checkpoints = more resumable points, more SWA bytes")
    h.add_argument("--no-layerwise-load", action="store_true",
                   help="load host KV for all layers before computing (default: layer by layer, overlapped)")
    h.add_argument("--l3-timeout-s", type=float, default=2.0,
                   help="longest wait on GCache per call; after a failure L3 is skipped for a while")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        engine, name = build_engine(args)
    except (ValueError, OSError, GCacheError) as e:
        print(f"gcache-worker: {e}", file=sys.stderr)
        return 2
    server, loop = make_server(engine, args.host, args.port, name, args.request_timeout_s, args.max_in_flight,
                               args.integrity_check_s)
    loop.start()

    def stop(signum, frame):  # shutdown() blocks until serve_forever returns: call it elsewhere
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    tiers = "L1"
    host_cache = getattr(engine.cache, "host", None)
    if host_cache is not None:
        tiers += f" + L2 ({host_cache.pool.total_bytes() >> 20} MiB)"
    if getattr(engine.cache, "l3", None) is not None:
        tiers += f" + L3 ({args.l3})"
    print(f"gcache-worker: serving {name} on http://{host}:{port} "
          f"(full pages {engine.kv.full.num_pages}, swa pages {engine.kv.swa.num_pages}; cache {tiers})", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        loop.stopping.set()
        loop.join(timeout=10)
        server.server_close()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
