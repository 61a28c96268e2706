"""gcache-router pairing a prefill and a decode gcache-worker (real processes, one real
gcache-server): the client's answer equals a mixed worker's, token for token, streamed or
not, completions and chat, through the official openai client; the SSE stream carries every
token once; short prompts bypass the prefill pool; pools are discovered from a real Redis
by the workers' --role."""

from __future__ import annotations

import json

import pytest

from tests.support import waiting
from tests.support.pd_support import pd_worker, stream_text
from tests.support.serving_support import RouterProc, WorkerProc, metric, openai_client, post_json, request, start_all

pytestmark = pytest.mark.process  # starts processes

PROMPT = "The router pairs a prefill worker with a decode worker for this prompt. " * 3
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.support.servers import ServerProcess

    d = tmp_path_factory.mktemp("pd-router")
    server = ServerProcess(d / "node").start()
    pre, dec, mixed = start_all(
        [pd_worker(d, "prefill", server.address), pd_worker(d, "decode", server.address), WorkerProc(d)]
    )
    router = RouterProc(
        d,
        None,
        ["--prefill-workers", pre.url, "--decode-workers", dec.url, "--pd-min-prompt-tokens", "64"],
    ).start()
    yield pre, dec, mixed, router
    for p in (router, pre, dec, mixed):
        assert p.stop() == 0, p.log()
    server.kill()


def reference(mixed, path: str, req: dict) -> str:
    status, body, _ = post_json(mixed.port, path, {**req, "stream": False})
    assert status == 200, body
    c = body["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def test_plain_and_streamed_completions_equal_a_mixed_worker(cluster):
    pre, dec, mixed, router = cluster
    req = {"prompt": PROMPT, "max_tokens": 24, **GREEDY}
    ref = reference(mixed, "/v1/completions", req)
    status, body, headers = post_json(router.port, "/v1/completions", req)
    assert status == 200 and body["choices"][0]["text"] == ref
    assert headers["x-gcache-worker"] == dec.url and body["usage"]["completion_tokens"] == 24
    status, events, headers = post_json(router.port, "/v1/completions", {**req, "prompt": PROMPT + "!", "stream": True})
    assert status == 200 and headers["x-gcache-prefill-worker"] == pre.url and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert stream_text(chunks) == reference(mixed, "/v1/completions", {**req, "prompt": PROMPT + "!"})
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len({c["id"] for c in chunks}) == 1
    assert metric(router.port, "gcache_router_pd_requests_total") >= 2


def test_the_openai_client_streams_chat_through_the_pair(cluster):
    openai = pytest.importorskip("openai")  # noqa: F841
    pre, dec, mixed, router = cluster
    messages = [{"role": "user", "content": PROMPT}]
    ref = reference(mixed, "/v1/chat/completions", {"messages": messages, "max_tokens": 20, **GREEDY})
    client = openai_client(router.url)
    extra = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    chunks = list(
        client.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref
    assert [ch.choices[0].delta.role for ch in chunks if ch.choices].count("assistant") == 1
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens > len(PROMPT)
    c = client.chat.completions.create(model="any", messages=messages, max_tokens=20, **extra)
    assert c.choices[0].message.content == ref and c.choices[0].finish_reason == "length"


def test_short_prompts_and_one_token_answers(cluster):
    pre, dec, mixed, router = cluster
    short = {"prompt": "Short prompt.", "max_tokens": 8, **GREEDY}
    bypass = metric(router.port, "gcache_router_pd_bypass_total")
    status, body, headers = post_json(router.port, "/v1/completions", short)
    assert status == 200 and body["choices"][0]["text"] == reference(mixed, "/v1/completions", short)
    assert headers["x-gcache-worker"] == dec.url and "x-gcache-prefill-worker" not in headers
    assert metric(router.port, "gcache_router_pd_bypass_total") == bypass + 1
    one = {"prompt": PROMPT + "one", "max_tokens": 1, **GREEDY}
    status, events, headers = post_json(router.port, "/v1/completions", {**one, "stream": True})
    assert status == 200 and headers["x-gcache-prefill-worker"] == pre.url
    assert stream_text(events[:-1]) == reference(mixed, "/v1/completions", one)


def test_a_bad_request_gets_the_workers_400(cluster):
    *_, router = cluster
    status, body, _ = post_json(router.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 100000})
    assert status == 400 and "max_tokens" in body["error"]["message"]


def test_pools_from_redis_by_role(cluster, redis_server, tmp_path):
    """Workers register with their --role; a --pd router pools them by it."""
    from tests.support.servers import ServerProcess

    _, _, mixed, _ = cluster
    server = ServerProcess(tmp_path / "node").start()
    redis = ["--redis", f"redis://{redis_server}/0"]
    pre, dec = start_all(
        [
            pd_worker(tmp_path, "prefill", server.address, redis),
            pd_worker(tmp_path, "decode", server.address, redis),
        ]
    )
    router = RouterProc(tmp_path, None, ["--pd", *redis]).start()
    try:

        def pools_ready() -> bool:
            status, raw, _ = request(router.port, "GET", "/health")
            h = json.loads(raw)
            urls = lambda pool: [w["url"] for w in h[pool]["workers"]]  # noqa: E731
            return status == 200 and urls("prefill") == [pre.url] and urls("decode") == [dec.url]

        waiting.wait_until(pools_ready, "both pools registered", timeout_s=20.0, step_s=0.05)
        req = {"prompt": PROMPT + " via redis", "max_tokens": 12, **GREEDY}
        status, events, headers = post_json(router.port, "/v1/completions", {**req, "stream": True})
        assert status == 200 and headers["x-gcache-prefill-worker"] == pre.url
        assert stream_text(events[:-1]) == reference(mixed, "/v1/completions", req)
    finally:
        for p in (router, pre, dec):
            assert p.stop() == 0, p.log()
        server.kill()
