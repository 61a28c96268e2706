"""The HTTP layer under abuse, against real gcache-worker processes (issue 12's four cases).

Each case is reproduced, and a legitimate client is served right after (or during) it.
"""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from tests.support.serving_support import (
    GREETING,
    WorkerProc,
    burst,
    metric,
    post_json,
    read_response,
    request,
    stalled_connections,
)

pytestmark = pytest.mark.process  # starts processes

BURST = 200
SLOTS = 8
WAIT_S = 60.0


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = WorkerProc(
        tmp_path_factory.mktemp("hardening"), ["--max-in-flight", str(SLOTS), "--body-timeout-s", "2"]
    ).start()
    yield w
    assert w.stop() == 0, w.log()


@pytest.fixture(scope="module")
def roomy_worker(tmp_path_factory):
    w = WorkerProc(tmp_path_factory.mktemp("roomy")).start()
    yield w
    assert w.stop() == 0, w.log()


@pytest.fixture(scope="module")
def expected_text(worker):
    status, body, _ = post_json(worker.port, "/v1/completions", GREETING)
    assert status == 200, body
    return body["choices"][0]["text"]


def assert_served(worker, expected_text) -> None:
    status, body, _ = post_json(worker.port, "/v1/completions", GREETING)
    assert status == 200 and body["choices"][0]["text"] == expected_text, body


# ---- 1. a burst of 200 ------------------------------------------------------------------------------------
def test_burst_of_200_is_queued_not_reset(roomy_worker):
    results = burst(roomy_worker.port, BURST)
    errors = [r for r in results if not isinstance(r, tuple)]
    assert errors == [], f"{len(errors)} clients failed, first: {errors[0]!r}"
    texts = {r[1]["choices"][0]["text"] for r in results}
    assert all(r[0] == 200 for r in results) and len(texts) == 1  # every one served, the same greedy text


def test_burst_over_the_in_flight_limit_gets_503_never_a_reset(worker, expected_text):
    results = burst(worker.port, BURST)
    errors = [r for r in results if not isinstance(r, tuple)]
    assert errors == [], f"{len(errors)} clients failed, first: {errors[0]!r}"
    statuses = {r[0] for r in results}
    assert statuses <= {200, 503} and 200 in statuses
    for status, body in results:
        if status == 200:
            assert body["choices"][0]["text"] == expected_text
        else:
            assert (
                body["error"]["type"] == "overloaded"
                and "too many requests in flight (limit 8)" in body["error"]["message"]
            )
    assert_served(worker, expected_text)


# ---- 2. stalled bodies hold no slot ---------------------------------------------------------------------------
def test_clients_that_send_headers_and_stop_do_not_hold_the_slots(worker, expected_text):
    stalled = stalled_connections(worker.port, SLOTS) + stalled_connections(worker.port, SLOTS, b'{"prompt": "')
    half = socket.create_connection(("127.0.0.1", worker.port), timeout=WAIT_S)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    try:
        # All 8 slots are free: 8 legitimate clients at once are all served.
        results = burst(worker.port, SLOTS)
        assert [r[0] for r in results] == [200] * SLOTS, results
        assert {r[1]["choices"][0]["text"] for r in results} == {expected_text}
        # The stalled ones get 408 once --body-timeout-s passes, and their connection is closed.
        for s in stalled:
            status, headers, body = read_response(s)
            assert status == 408 and "not received within 2 s" in json.loads(body)["error"]["message"]
            assert headers.get("connection", "").lower() == "close"
            assert s.recv(1) == b""
    finally:
        for s in stalled + [half]:
            s.close()
    assert metric(worker.port, "gcache_worker_http_body_timeouts_total") >= 2 * SLOTS
    assert_served(worker, expected_text)


# ---- 3. malformed JSON ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, fragment",
    [
        (b'{"prompt": "ab\\ud800cd"}', "lone surrogate"),
        (json.dumps({"prompt": "ab\ud800cd"}).encode(), "lone surrogate"),
        (b"[" * 200_000 + b"]" * 200_000, "nested deeper than"),
        (b'{"prompt": ' + b"[" * 50 + b"]" * 50 + b"}", "nested deeper than 32"),
        (b'{"prompt": "\xc3\x28"}', "not valid UTF-8"),
        (b'{"prompt": "x", "max_tokens": NaN}', "NaN is not valid JSON"),
    ],
)
def test_malformed_json_gets_400_not_an_empty_reply(worker, expected_text, body, fragment):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, raw, headers = request(worker.port, "POST", path, body, {"Content-Type": "application/json"})
        assert status == 400 and headers["content-type"].startswith("application/json"), raw[:200]
        err = json.loads(raw)["error"]
        assert fragment in err["message"] and err["code"] == 400 and err["type"] == "invalid_request_error"
    assert_served(worker, expected_text)


# ---- 4. bodies over 8 MiB --------------------------------------------------------------------------------------
BIG = 9 << 20


def test_body_over_8_mib_with_content_length_gets_413_after_sending_it_all(worker, expected_text):
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=WAIT_S)
    try:  # http.client writes the whole body before it reads: a server that closes early breaks its pipe
        conn.request("POST", "/v1/completions", body=b"x" * BIG, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, body = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 413 and body["error"]["message"] == f"body of {BIG} bytes exceeds the limit of {8 << 20} bytes"
    assert_served(worker, expected_text)


def test_chunked_body_over_8_mib_gets_413(worker, expected_text):
    def chunks():
        piece = b"y" * (1 << 20)
        for _ in range(BIG >> 20):
            yield piece

    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=WAIT_S)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=chunks(),
            encode_chunked=True,
            headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        )
        resp = conn.getresponse()
        status, body = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 413 and "exceeds the limit" in body["error"]["message"]
    assert_served(worker, expected_text)


def test_expect_100_continue_over_the_limit_gets_413_before_the_body(worker, expected_text):
    with socket.create_connection(("127.0.0.1", worker.port), timeout=WAIT_S) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {BIG}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        status, _, body = read_response(s)  # not one body byte was sent
        assert status == 413 and "exceeds the limit" in json.loads(body)["error"]["message"]
    with socket.create_connection(("127.0.0.1", worker.port), timeout=WAIT_S) as s:
        body = json.dumps(GREETING).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        assert s.recv(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        status, _, raw = read_response(s)
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected_text


def test_a_body_cut_short_does_not_hold_anything(worker, expected_text):
    with socket.create_connection(("127.0.0.1", worker.port), timeout=WAIT_S) as s:
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"prompt"')
        s.shutdown(socket.SHUT_WR)
        assert s.recv(65536) is not None  # closed (or a 400): either way nothing hangs
    assert_served(worker, expected_text)
    status, body, _ = request(worker.port, "GET", "/health")
    assert status == 200 and json.loads(body)["in_flight"] == 0
