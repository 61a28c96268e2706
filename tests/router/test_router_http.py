"""A real gcache-router process in front of real gcache-worker processes (static --workers list).

The official `openai` client streams completions and chat through the router; the router
adds x-gcache-worker, retries a dead or killed worker once on another, answers 503 naming
the failures when none can take a request, and holds under the same abuse as the worker.
Every worker runs the same seeded model, so any worker's greedy answer is the reference.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from gcache.common.processes import free_port
from tests.support.serving_support import (
    RouterProc,
    WorkerProc,
    burst,
    metric,
    openai_client,
    post_json,
    read_response,
    request,
    stalled_connections,
    start_all,
)

pytestmark = pytest.mark.process  # starts processes

openai = pytest.importorskip("openai")

PROMPT = "Routed through gcache-router, streamed back chunk by chunk. "
MESSAGES = [{"role": "user", "content": "Tell me about routers."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WAIT_S = 30.0


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router-workers")
    ws = start_all([WorkerProc(log_dir) for _ in range(2)])
    yield ws
    for w in ws:
        assert w.stop() == 0, w.log()


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    r = RouterProc(
        tmp_path_factory.mktemp("router"),
        [w.url for w in workers],
        ["--policy", "round_robin", "--max-in-flight", "4", "--body-timeout-s", "2"],
    ).start()
    yield r
    assert r.stop() == 0, r.log()


@pytest.fixture
def start_router(tmp_path):
    started = []

    def start(urls, *extra) -> RouterProc:
        r = RouterProc(tmp_path, urls, ["--policy", "round_robin", *extra]).start()
        started.append(r)
        return r

    yield start
    for r in started:
        r.kill()


def reference(worker, **payload) -> dict:
    status, body, _ = post_json(worker.port, "/v1/completions", {**payload, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


# ---- the OpenAI API through the router -------------------------------------------------------------------
def test_openai_client_streams_completions_and_chat_through_the_router(workers, router):
    client = openai_client(router.url)
    urls = {w.url for w in workers}
    text = reference(workers[0], prompt=PROMPT, max_tokens=24)["choices"][0]["text"]
    raw = client.completions.with_raw_response.create(model="any", prompt=PROMPT, max_tokens=24, **GREEDY)
    assert raw.headers["x-gcache-worker"] in urls and raw.parse().choices[0].text == text
    raw = client.completions.with_raw_response.create(
        model="any", prompt=PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    assert raw.headers["x-gcache-worker"] in urls and raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    assert len(chunks) > 2 and "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.prompt_tokens == len(PROMPT) and chunks[-1].usage.completion_tokens == 24

    status, direct, _ = post_json(
        workers[1].port,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 20, "temperature": 0, "ignore_eos": True},
    )
    answer = direct["choices"][0]["message"]["content"]
    c = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=20, **GREEDY)
    assert c.choices[0].message.content == answer
    chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=20, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == answer


def test_stop_strings_through_the_router(workers, router):
    ref = reference(workers[0], prompt=PROMPT, max_tokens=48)
    data = bytes(t % 256 for t in ref["choices"][0]["token_ids"])
    at = next(
        i
        for i in range(2, len(data) - 1)
        if all(32 <= b < 127 for b in data[i : i + 2]) and data.find(data[i : i + 2]) == i
    )
    stop = data[at : at + 2].decode()
    expected = data[:at].decode("utf-8", errors="replace")
    client = openai_client(router.url)
    c = client.completions.create(model="any", prompt=PROMPT, max_tokens=48, stop=[stop], **GREEDY)
    assert c.choices[0].text == expected and c.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model="any", prompt=PROMPT, max_tokens=48, stop=stop, stream=True, **GREEDY)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_round_robin_order_and_the_worker_header(workers, start_router):
    r = start_router([w.url for w in workers])
    order = sorted(w.url for w in workers)
    before = {w.url: metric(w.port, "gcache_worker_requests_total") for w in workers}
    seen = [
        post_json(r.port, "/v1/completions", {"prompt": "rr", "max_tokens": 2})[2]["x-gcache-worker"] for _ in range(4)
    ]
    assert seen == [order[0], order[1], order[0], order[1]]
    after = {w.url: metric(w.port, "gcache_worker_requests_total") for w in workers}
    assert {u: after[u] - before[u] for u in after} == {order[0]: 2, order[1]: 2}  # the header tells the truth


# ---- failures -------------------------------------------------------------------------------------------
def test_dead_worker_in_the_list_is_retried_on_the_other(workers, start_router):
    live = workers[0]
    r = start_router([dead_url(), live.url])
    text = reference(live, prompt=PROMPT, max_tokens=8)["choices"][0]["text"]
    for _ in range(3):  # round robin reaches the dead one within two picks
        status, body, headers = post_json(
            r.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        )
        assert status == 200 and headers["x-gcache-worker"] == live.url and body["choices"][0]["text"] == text
    assert metric(r.port, "gcache_router_http_retries_total") >= 1
    assert metric(r.port, "gcache_router_http_upstream_errors_total") >= 1


def test_no_worker_can_answer_gives_503_naming_the_failures(start_router):
    dead = sorted([dead_url(), dead_url()])
    r = start_router(dead)
    status, body, _ = post_json(r.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and body["error"]["type"] == "overloaded"
    msg = body["error"]["message"]
    assert msg.startswith("no worker could take the request: ") and all(u in msg for u in dead), msg
    assert metric(r.port, "gcache_router_http_no_worker_total") == 1


def wait_inflight(router: RouterProc, url: str, done: threading.Event) -> bool:
    """True once the router has a request in flight to url; False if the request finished first."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not done.is_set():
        health = json.loads(request(router.port, "GET", "/health")[1])
        if any(w["url"] == url and w["inflight"] >= 1 for w in health["workers"]):
            return True
        time.sleep(0.02)
    if not done.is_set():
        raise TimeoutError("the request neither reached the worker nor finished")
    return False


def test_worker_killed_mid_request_is_retried_on_the_other(workers, start_router, tmp_path):
    survivor = workers[0]
    victim = WorkerProc(tmp_path).start()
    try:
        r = start_router([victim.url, survivor.url])
        text = reference(survivor, prompt=PROMPT, max_tokens=8)["choices"][0]["text"]
        victim.signal(signal.SIGSTOP)  # it accepts connections (kernel backlog) but answers nothing
        for _ in range(2):  # round robin sends one of the next two requests to the victim
            out, done = [], threading.Event()

            def send():
                out.append(
                    post_json(
                        r.port,
                        "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                        timeout=WAIT_S,
                    )
                )
                done.set()

            t = threading.Thread(target=send)
            t.start()
            reached = wait_inflight(r, victim.url, done)
            if reached:
                victim.kill()  # SIGKILL mid-request: its connections are reset
            t.join(WAIT_S)
            status, body, headers = out[0]
            assert status == 200 and headers["x-gcache-worker"] == survivor.url, body
            assert body["choices"][0]["text"] == text
            if reached:
                break
        else:
            pytest.fail("no request reached the victim")
        assert metric(r.port, "gcache_router_http_retries_total") == 1
        health = json.loads(request(r.port, "GET", "/health")[1])
        assert (
            next(w for w in health["workers"] if w["url"] == victim.url)["backoff_s"] > 0
            or metric(r.port, "gcache_router_worker_failures_total") >= 1
        )
    finally:
        victim.kill()


def test_worker_killed_mid_stream_ends_the_stream_with_an_error(workers, start_router, tmp_path):
    # 2000 tokens take the tiny model seconds; the kill comes right after the first chunk arrives.
    victim = WorkerProc(tmp_path, ["--max-new-tokens", "2000", "--kv-budget-mib", "4"]).start()
    try:
        r = start_router([victim.url])
        stream = openai_client(r.url).completions.create(
            model="any", prompt=PROMPT, max_tokens=2000, stream=True, **GREEDY
        )
        got = []
        with pytest.raises(openai.APIError) as e:
            for chunk in stream:
                got.append(chunk.choices[0].text)
                if len(got) == 1:
                    victim.kill()
        assert f"worker {victim.url} failed mid-answer" in str(e.value)
        assert 1 <= len(got) < 2000
        assert metric(r.port, "gcache_router_http_broken_answers_total") == 1
    finally:
        victim.kill()


# ---- the router holds under the same abuse as the worker ---------------------------------------------------
def test_router_rejects_malformed_bodies_and_oversized_ones(router, workers):
    for body, status, fragment in [
        (b'{"prompt": "ab\\ud800cd"}', 400, "lone surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested deeper than"),
        (b'{"messages": []}', 404, "no such endpoint"),
        (b"z" * (9 << 20), 413, "exceeds the limit"),
    ]:
        path = "/v1/nope" if status == 404 else "/v1/completions"
        got, raw, _ = request(router.port, "POST", path, body, {"Content-Type": "application/json"})
        assert got == status and fragment in json.loads(raw)["error"]["message"]
    status, body, headers = post_json(router.port, "/v1/completions", {"prompt": "still served", "max_tokens": 2})
    assert status == 200 and headers["x-gcache-worker"] in {w.url for w in workers}


def test_router_stalled_bodies_hold_no_slot_and_a_burst_is_not_reset(router):
    stalled = stalled_connections(router.port, 4)  # the router has 4 slots
    try:
        results = burst(router.port, 4)
        assert [r[0] for r in results] == [200] * 4, results
        for s in stalled:
            assert read_response(s)[0] == 408
    finally:
        for s in stalled:
            s.close()
    results = burst(router.port, 200)
    errors = [r for r in results if not isinstance(r, tuple)]
    assert errors == [], f"{len(errors)} clients failed, first: {errors[0]!r}"
    assert {r[0] for r in results} <= {200, 503} and 200 in {r[0] for r in results}
    assert all(
        r[1]["error"]["message"].startswith("too many requests in flight (limit 4)") for r in results if r[0] == 503
    )


def test_router_health_and_metrics(router, workers):
    status, body, _ = request(router.port, "GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["policy"] == "round_robin"
    assert sorted(w["url"] for w in health["workers"]) == sorted(w.url for w in workers)
    status, body, headers = request(router.port, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'gcache_router_picks_total{mode="round_robin"}' in text  # the core's
    assert 'gcache_router_http_responses_total{route="/v1/completions",code="200"}' in text  # the server's
    assert metric(router.port, "gcache_router_http_in_flight") == 0
