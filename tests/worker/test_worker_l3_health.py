"""A worker whose L3 store is not there says so: in its log at start, in /health ("l3": up or
unreachable, when it last answered), and again in the log when the store answers and when it
goes away again. It serves throughout, without L3 while the store is unreachable.

A real gcache-worker and a real gcache-server, plus L3Store's health on a scripted client.
Every wait is a poll with a generous bound; nothing asserts how long anything took.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matmuls: threads only add contention

import json
import logging
import signal
import time

import numpy as np
import pytest

from gcache import errors
from gcache.worker.kvcache.tiers.host_cache import HostCache
from gcache.worker.kvcache.tiers.host_pool import HostKVPool
from gcache.worker.kvcache.tiers.l3_store import L3Config, L3Store
from tests.support.serving_support import WorkerProc, post_json, request
from tests.support.tiered_cache_support import CFG

POLL_BOUND_S = 30.0  # a loaded 2-core machine probes every 2 s; this is only an upper bound


def health(port: int) -> dict:
    status, body, _ = request(port, "GET", "/health", timeout=10)
    assert status == 200, body  # the worker is healthy with or without its L3
    return json.loads(body)


def poll_l3_state(port: int, state: str) -> dict:
    """/health until its l3.state is `state` (bounded); returns that answer."""
    deadline = time.monotonic() + POLL_BOUND_S
    while True:
        answer = health(port)
        if answer["l3"]["state"] == state:
            return answer
        assert time.monotonic() < deadline, f"/health l3 never became {state!r}: {answer}"
        time.sleep(0.2)


def log_count(worker: WorkerProc, text: str) -> int:
    return worker.log_path.read_text(errors="replace").count(text)


def poll_log(worker: WorkerProc, text: str, count: int) -> None:
    """Until the worker's log has `text` `count` times (bounded): the line is written just
    after /health's state flips, so it may trail it a little."""
    deadline = time.monotonic() + POLL_BOUND_S
    while log_count(worker, text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} time(s): {worker.log()}"
        time.sleep(0.1)
    assert log_count(worker, text) == count, worker.log()  # once per edge, not per failed call


@pytest.mark.process
def test_worker_says_l3_is_unreachable_then_back_then_gone_again(server, tmp_path):
    address = server.address
    server.stop(signal.SIGKILL)  # the store is not there when the worker starts
    worker = WorkerProc(tmp_path, ["--l2-mib", "1", "--l3", address]).start()
    try:
        first = health(worker.port)
        l3 = first["l3"]
        assert first["status"] == "ok"
        assert l3["state"] == "unreachable" and l3["address"] == address
        assert l3["last_seen"] is None and l3["last_seen_s_ago"] is None  # it never answered
        assert l3["unreachable_since"] and "connect" in l3["last_error"].lower()
        assert log_count(worker, f"L3 {address} is unreachable") == 1  # logged at start
        assert f"L3 ({address}, UNREACHABLE at start" in worker.log()
        payload = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        status, body, _ = post_json(worker.port, "/v1/completions", payload)
        assert status == 200 and body["usage"]["completion_tokens"] == 3  # it serves without L3

        server.start()  # same port, same data dir
        up = poll_l3_state(worker.port, "up")["l3"]
        assert up["last_seen"] is not None and up["last_seen_s_ago"] >= 0
        assert up["unreachable_since"] is None and up["last_error"] is None
        poll_log(worker, f"L3 {address} answers again", 1)

        server.stop(signal.SIGKILL)  # it goes away again: nobody sends a request meanwhile
        gone = poll_l3_state(worker.port, "unreachable")["l3"]
        assert gone["last_seen"] is not None  # when it was last seen stays
        assert gone["unreachable_since"] is not None and gone["last_error"]
        poll_log(worker, f"L3 {address} is unreachable", 2)
    finally:
        code = worker.stop()
    assert code == 0, worker.log()


class ScriptedClient:
    """A client whose ping answers, or fails, as the test says; nothing else is called."""

    def __init__(self):
        self.answer: dict | Exception = errors.ConnectionError("connection refused")
        self.pings = 0

    def ping(self):
        self.pings += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def register_buffer(self, *a, **k):
        pass

    def close(self):
        pass


def scripted_store(client) -> L3Store:
    host = HostCache(HostKVPool(CFG, 4, 2, xp=np))
    return L3Store(L3Config(url="127.0.0.1:1", model="m"), host, CFG.window, CFG.page_size, client=client)


def test_l3_health_follows_the_store_and_logs_each_edge_once(caplog):
    client = ScriptedClient()
    l3 = scripted_store(client)
    caplog.set_level(logging.WARNING, logger="gcache.worker.l3")
    try:
        assert l3.health()["state"] == "unknown"  # never asked
        assert not l3.probe() and not l3.probe()
        h = l3.health()
        assert h["state"] == "unreachable" and h["last_seen"] is None and "refused" in h["last_error"]
        assert not l3.available()  # skipped for suspect_s, like after any failed call
        assert [r.getMessage() for r in caplog.records if "is unreachable" in r.getMessage()] == [
            "L3 127.0.0.1:1 is unreachable (ConnectionError: connection refused): serving without it "
            "(no L3 reads or writes), trying it again every 2.0s; /health shows when it answers"
        ]  # one line per outage, not per failed call

        client.answer = {"version": "x", "epoch": 1, "map": b""}
        assert l3.probe() and l3.probe()
        h = l3.health()
        assert h["state"] == "up" and h["last_seen"] and h["unreachable_since"] is None and h["last_error"] is None
        assert l3.available()  # an answer ends the suspect window
        assert sum("answers again" in r.getMessage() for r in caplog.records) == 1

        client.answer = {"node-a": "ConnectionError: refused", "node-b": "TimeoutError: slow"}  # a cluster, all down
        assert not l3.probe()
        assert l3.health()["state"] == "unreachable" and "node-b: TimeoutError" in l3.health()["last_error"]
        client.answer = {"node-a": {"version": "x"}, "node-b": "TimeoutError: slow"}  # one node answers
        assert l3.probe() and l3.health()["state"] == "up"
        assert sum("is unreachable" in r.getMessage() for r in caplog.records) == 2
        assert sum("answers again" in r.getMessage() for r in caplog.records) == 2
    finally:
        l3.close()
