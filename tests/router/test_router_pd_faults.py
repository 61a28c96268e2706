"""PD faults through a real gcache-router, each with its limit: a prefill worker that is
dead or never answers is replaced once, then the client gets a 503; a decode worker that
breaks off mid-stream ends the stream with an error event and [DONE] (no hang); L3 down
sends requests whole to the decode workers, with the same output."""

from __future__ import annotations

import socket
import threading

import pytest

from gcache.common.processes import free_port
from tests.support import waiting
from tests.support.pd_support import pd_worker, stream_text
from tests.support.serving_support import RouterProc, WorkerProc, metric, post_json, start_all

pytestmark = pytest.mark.process  # starts processes, listens

PROMPT = "A fault on the way from prefill to decode must never change the answer. " * 3
GREEDY = {"temperature": 0, "ignore_eos": True}
PREFILL_TIMEOUT = ["--pd-prefill-timeout-s", "2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.support.servers import ServerProcess

    d = tmp_path_factory.mktemp("pd-faults")
    server = ServerProcess(d / "node").start()
    procs = start_all([pd_worker(d, "prefill", server.address), pd_worker(d, "decode", server.address), WorkerProc(d)])
    yield d, server, procs
    for p in procs:
        assert p.stop() == 0, p.log()
    server.kill()


@pytest.fixture
def silent():
    """A listener that never accepts: a worker that takes the connection and never answers."""
    s = socket.create_server(("127.0.0.1", 0), backlog=16)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def reference(mixed, req: dict) -> str:
    status, body, _ = post_json(mixed.port, "/v1/completions", {**req, "stream": False})
    assert status == 200, body
    return body["choices"][0]["text"]


def router(d, prefill: list[str], decode: list[str], extra=()) -> RouterProc:
    args = ["--prefill-workers", ",".join(prefill), "--decode-workers", ",".join(decode), "--policy", "round_robin"]
    return RouterProc(d, None, args + PREFILL_TIMEOUT + list(extra)).start()


def test_a_dead_or_silent_prefill_worker_is_replaced_once_then_503(cluster, silent):
    d, _, (pre, dec, mixed) = cluster
    r = router(d, [silent, pre.url], [dec.url])
    try:
        for i in range(2):  # round robin: one of the first two starts on the silent worker
            req = {"prompt": PROMPT + str(i), "max_tokens": 10, **GREEDY}
            status, body, _ = post_json(r.port, "/v1/completions", req)
            assert status == 200 and body["choices"][0]["text"] == reference(mixed, req)
        assert metric(r.port, "gcache_router_pd_prefill_retries_total") >= 1  # (its backoff may lapse)
    finally:
        assert r.stop() == 0, r.log()
    r = router(d, [dead_url(), silent], [dec.url])
    try:
        status, body, _ = post_json(r.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **GREEDY})
        assert status == 503 and "no prefill worker could take the request" in body["error"]["message"]
        assert "within 2 s" in body["error"]["message"]  # the silent one timed out
        assert metric(r.port, "gcache_router_pd_prefill_failed_total") == 1
    finally:
        assert r.stop() == 0, r.log()


class BreaksMidStream:
    """A decode 'worker' that answers every request with the SSE headers and one chunk, then
    drops the connection."""

    CHUNK = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"?"}]}\n\n'

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536) or b"\r\n\r\n"
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + self.CHUNK)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_a_decode_worker_breaking_off_mid_stream_ends_it_with_an_error(cluster):
    d, _, (pre, dec, mixed) = cluster
    fake = BreaksMidStream()
    r = router(d, [pre.url], [fake.url])
    try:
        req = {"prompt": PROMPT + "broken", "max_tokens": 10, "stream": True, **GREEDY}
        status, events, _ = post_json(r.port, "/v1/completions", req, timeout=30)
        assert status == 200 and events[-1] == "[DONE]"
        assert "failed mid-answer" in events[-2]["error"]["message"]
        assert metric(r.port, "gcache_router_http_broken_answers_total") == 1
    finally:
        assert r.stop() == 0, r.log()
        fake.close()
    r = router(d, [pre.url], [dead_url(), dec.url])  # dead before answering: the other one continues
    try:
        for i in range(2):
            req = {"prompt": PROMPT + f"retry {i}", "max_tokens": 10, **GREEDY}
            status, events, _ = post_json(r.port, "/v1/completions", {**req, "stream": True})
            assert status == 200 and stream_text(events[:-1]) == reference(mixed, req)
    finally:
        assert r.stop() == 0, r.log()


def test_l3_down_falls_back_to_whole_requests_on_decode_workers(cluster):
    """Last in the module: it kills the store."""
    d, server, (pre, dec, mixed) = cluster
    r = router(d, [pre.url], [dec.url])
    try:
        reqs = [{"prompt": PROMPT + f"l3 down {i}", "max_tokens": 8, **GREEDY} for i in range(6)]
        refs = [reference(mixed, q) for q in reqs]
        server.kill()
        for q, ref in zip(reqs, refs):  # the first ones find out (handoffs recompute), the rest fall back
            status, body, _ = post_json(r.port, "/v1/completions", q)
            assert status == 200 and body["choices"][0]["text"] == ref
        waiting.wait_until(
            lambda: metric(r.port, "gcache_router_pd_l3_down_fallback_total") >= 1, "an L3-down fallback", 5.0
        )
    finally:
        assert r.stop() == 0, r.log()
