"""The worker's aiohttp app in process, on a real loopback socket: request timeouts, clients that
go away mid-stream, and shutdown with a stream open. A step hook gates the engine thread so
each case happens at a known point (no dependence on thread timing)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

from gcache.serving import runner
from gcache.serving.sse import parse_events
from gcache.worker.http.flags import build_engine, parse_args
from gcache.worker.http.server import make_app
from tests.support.engine_support import InEngine
from tests.support.serving_support import WORKER_ARGS, post_json, request

WAIT_S = 30.0
PROMPT = "In process, on a real socket. "


class Gate:
    """Step hook: once armed, the engine thread waits after a step that produced a token until
    the test opens the gate (bounded)."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.open = threading.Event()
        self.reached = threading.Event()

    def __call__(self, engine) -> None:
        if self.armed.is_set() and not self.open.is_set() and any(r.output for r in engine.batcher.running):
            self.reached.set()
            self.open.wait(WAIT_S)


class InProcessWorker:
    def __init__(self, request_timeout_s: float) -> None:
        self.engine, name = build_engine(parse_args(WORKER_ARGS + ["--max-new-tokens", "1000", "--kv-budget-mib", "4"]))
        app, self.engine_thread = make_app(
            self.engine,
            name,
            request_timeout_s=request_timeout_s,
            max_in_flight=4,
            integrity_check_s=0,
            host_gauges={"host_check_swap": 0, "host_check_numa_balancing": 1},
        )
        self.gate, self.in_engine = Gate(), InEngine()
        self.engine_thread.add_step_hook(self.gate)
        self.engine_thread.add_step_hook(self.in_engine)
        self.engine_thread.start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = self._call(runner.start(app, "127.0.0.1", 0))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def idle_and_clean(self) -> tuple[int, int, int, int]:
        """Once the engine has no work (bounded wait): its integrity checked, and (running,
        waiting, full pages used, full pages the cache owns)."""

        def state(e):
            e.check_integrity()
            return len(e.batcher.running), len(e.scheduler.waiting), e.kv.full.num_used, e.cache.cached_pages()[0]

        deadline = time.monotonic() + WAIT_S
        while True:
            got = self.in_engine.run(state)
            if got[:2] == (0, 0) or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    def counter(self, name: str) -> float:
        text = request(self.port, "GET", "/metrics")[1].decode()
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))

    def close(self) -> None:
        self.gate.open.set()
        self.engine_thread.stopping.set()
        self.engine_thread.join(10)
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.engine.close()


@pytest.fixture
def worker():
    w = InProcessWorker(request_timeout_s=2.0)
    yield w
    w.close()


@pytest.mark.process
def test_request_timeout_answers_504_and_cancels_the_work(worker):
    worker.gate.armed.set()  # the engine holds after the first token: the request cannot finish in time
    status, body, _ = post_json(
        worker.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    )
    assert status == 504 and body["error"]["message"] == "request did not finish within 2 s"
    worker.gate.open.set()
    running, waiting, used, tree_full = worker.idle_and_clean()
    assert (running, waiting) == (0, 0) and used == tree_full  # cancelled, not computed to the end
    assert worker.counter("gcache_worker_http_request_timeouts_total") == 1
    assert worker.counter("gcache_worker_generation_tokens_total") < 500
    status, body, _ = post_json(worker.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


@pytest.mark.process
def test_client_gone_mid_stream_cancels_the_request(worker):
    worker.gate.armed.set()
    s = socket.create_connection(("127.0.0.1", worker.port), timeout=WAIT_S)
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert worker.gate.reached.wait(WAIT_S)
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    s.close()  # gone while the engine is held after its first token: 899 tokens were still to come
    worker.gate.open.set()
    running, waiting, used, tree_full = worker.idle_and_clean()
    assert (running, waiting) == (0, 0) and used == tree_full
    assert worker.counter("gcache_worker_http_client_gone_total") == 1
    assert worker.counter("gcache_worker_generation_tokens_total") < 900


@pytest.mark.process
def test_shutdown_with_a_stream_open_ends_it_with_an_error_event(worker):
    worker.gate.armed.set()
    out = []

    def stream():
        conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=WAIT_S)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": PROMPT, "max_tokens": 900, "stream": True, "ignore_eos": True}).encode(),
        )
        resp = conn.getresponse()
        out.append((resp.status, parse_events(resp.read())))
        conn.close()

    t = threading.Thread(target=stream)
    t.start()
    assert worker.gate.reached.wait(WAIT_S)
    worker.engine_thread.stopping.set()  # what SIGTERM does first
    worker.gate.open.set()
    t.join(WAIT_S)
    status, events = out[0]
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "request aborted: engine stopped" and events[-2]["error"]["code"] == 503
    status, body, _ = post_json(worker.port, "/v1/completions", {"prompt": "x"})
    assert status == 503 and "engine is not running" in body["error"]["message"]


@pytest.mark.process
def test_host_checks_are_gauges_in_the_workers_metrics(worker):
    assert worker.counter("gcache_worker_host_check_swap") == 0
    assert worker.counter("gcache_worker_host_check_numa_balancing") == 1
