"""PD handoff between real processes: a prefill and a decode gcache-worker over one real
gcache-server; the decode worker's answer equals a mixed worker's, token for token; records
that name another prompt's or model's pages are refused; missing pages are recomputed."""

from __future__ import annotations

import pytest

from gcache.serving.openai_api import CHAT_PATH, COMPLETIONS_PATH
from tests.support.pd_support import decode, pd_worker, prefill, stream_text
from tests.support.serving_support import WorkerProc, post_json, start_all

pytestmark = pytest.mark.process  # starts workers (and the server fixture)

PROMPT = "Prefill here, decode there: the KV travels through GCache page by page. " * 3  # ~220 tokens
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.support.servers import ServerProcess

    d = tmp_path_factory.mktemp("pd")
    server = ServerProcess(d / "node").start()
    procs = start_all(
        [
            pd_worker(d, "prefill", server.address),
            pd_worker(d, "decode", server.address),
            WorkerProc(d, ["--model-name", "pd-tiny"]),
        ]
    )
    yield procs
    for p in procs:
        assert p.stop() == 0, p.log()
    server.kill()


def mixed_answer(mixed, path, request):
    status, body, _ = post_json(mixed.port, path, request)
    assert status == 200, body
    return body


def test_decode_after_prefill_equals_mixed_token_for_token(cluster):
    pre, dec, mixed = cluster
    req = {"prompt": PROMPT, "max_tokens": 24, **GREEDY}
    ref = mixed_answer(mixed, COMPLETIONS_PATH, req)
    status, first, _ = prefill(pre.port, COMPLETIONS_PATH, req)
    assert status == 200 and first["done"] is False, first
    h = first["handoff"]
    assert h["prompt_tokens"] == len(PROMPT) and len(h["pages"]) == len(PROMPT) // 8
    assert h["stored_pages"] == len(h["pages"])  # every page in L3 before the answer
    status, rest, _ = decode(dec.port, COMPLETIONS_PATH, req, h)
    assert status == 200, rest
    assert rest["choices"][0]["text"] == ref["choices"][0]["text"]
    assert rest["id"] == h["response_id"] and rest["usage"]["completion_tokens"] == 24
    assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == len(h["pages"]) * 8  # an L3 hit


def test_streamed_pd_text_is_the_mixed_text_without_gap_or_duplicate(cluster):
    pre, dec, mixed = cluster
    for path, req in (
        (COMPLETIONS_PATH, {"prompt": PROMPT + "streamed", "max_tokens": 20, **GREEDY}),
        (CHAT_PATH, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20, **GREEDY}),
    ):
        kind = "chat" if path == CHAT_PATH else "completion"
        ref = mixed_answer(mixed, path, req)
        ref_text = ref["choices"][0]["message"]["content"] if kind == "chat" else ref["choices"][0]["text"]
        streamed = {**req, "stream": True}
        status, first, _ = prefill(pre.port, path, streamed)
        assert status == 200 and not first["done"], first
        status, events, _ = decode(dec.port, path, streamed, first["handoff"])
        assert status == 200 and events[-1] == "[DONE]"
        chunks = first["events"] + events[:-1]
        assert stream_text(chunks, kind) == ref_text
        assert {c["id"] for c in chunks} == {first["handoff"]["response_id"]}
        roles = [c for c in chunks if c["choices"] and c["choices"][0].get("delta", {}).get("role")]
        assert len(roles) == (1 if kind == "chat" else 0)  # the decode side sends no second role chunk


def test_a_handoff_for_another_prompt_or_model_is_refused(cluster):
    pre, dec, _ = cluster
    req = {"prompt": PROMPT + "victim", "max_tokens": 8, **GREEDY}
    status, first, _ = prefill(pre.port, COMPLETIONS_PATH, req)
    assert status == 200
    h = first["handoff"]
    other = {"prompt": "Another tenant's prompt, of another length.", "max_tokens": 8, **GREEDY}
    status, body, _ = decode(dec.port, COMPLETIONS_PATH, other, h)
    assert status == 400 and "prompt" in body["error"]["message"]
    same_len = {**req, "prompt": "X" + req["prompt"][1:]}
    status, body, _ = decode(dec.port, COMPLETIONS_PATH, same_len, h)
    assert status == 400 and "page-hash chain" in body["error"]["message"]
    status, body, _ = decode(dec.port, COMPLETIONS_PATH, req, {**h, "model": "someone-else"})
    assert status == 400 and "model" in body["error"]["message"]
    status, body, _ = decode(dec.port, COMPLETIONS_PATH, req, {**h, "pools": {**h["pools"], "mtp": [0, 1]}})
    assert status == 400 and "mtp" in body["error"]["message"]


def test_a_first_token_that_ends_the_request_is_answered_by_the_prefill(cluster):
    pre, _, mixed = cluster
    req = {"prompt": PROMPT, "max_tokens": 1, **GREEDY}
    ref = mixed_answer(mixed, COMPLETIONS_PATH, req)
    status, first, _ = prefill(pre.port, COMPLETIONS_PATH, req)
    assert status == 200 and first["done"] is True and "handoff" not in first
    assert first["body"]["choices"][0]["text"] == ref["choices"][0]["text"]


def test_missing_handoff_pages_are_recomputed_with_the_same_output(cluster, tmp_path):
    """A decode worker over an empty store (the pages are missing there) still answers right."""
    from tests.support.servers import ServerProcess

    pre, _, mixed = cluster
    empty = ServerProcess(tmp_path / "empty").start()
    lone = pd_worker(tmp_path, "decode", empty.address).start()
    try:
        req = {"prompt": PROMPT + "missing", "max_tokens": 16, **GREEDY}
        ref = mixed_answer(mixed, COMPLETIONS_PATH, req)
        status, first, _ = prefill(pre.port, COMPLETIONS_PATH, req)
        assert status == 200
        status, rest, _ = decode(lone.port, COMPLETIONS_PATH, req, first["handoff"])
        assert status == 200, rest
        assert rest["choices"][0]["text"] == ref["choices"][0]["text"]
        assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    finally:
        assert lone.stop() == 0, lone.log()
        empty.kill()


def test_corrupt_handoff_pages_are_recomputed_with_the_same_output(cluster, tmp_path):
    """A wrong-sized value under a page's key (what a torn or foreign write leaves) cuts the
    L3 hit there: the decode worker recomputes from that page on, and the answer is the same."""
    import gcache
    from gcache.wire.keys import KeyBuilder
    from tests.support.servers import ServerProcess

    pre, _, mixed = cluster
    store = ServerProcess(tmp_path / "store").start()
    lone_pre = pd_worker(tmp_path, "prefill", store.address)
    lone_dec = pd_worker(tmp_path, "decode", store.address)
    start_all([lone_pre, lone_dec])
    try:
        req = {"prompt": PROMPT + "corrupt", "max_tokens": 16, **GREEDY}
        ref = mixed_answer(mixed, COMPLETIONS_PATH, req)["choices"][0]["text"]
        status, first, _ = prefill(lone_pre.port, COMPLETIONS_PATH, req)
        assert status == 200 and first["handoff"]["stored_pages"] == len(first["handoff"]["pages"])
        bad = 5
        key = KeyBuilder(model="pd-tiny").key(first["handoff"]["pages"][bad], "full")
        with gcache.Client(store.address) as c:
            assert c.remove(key) and c.put(key, b"torn")  # (a put over a present key keeps the first value)
        status, rest, _ = decode(lone_dec.port, COMPLETIONS_PATH, req, first["handoff"])
        assert status == 200, rest
        assert rest["choices"][0]["text"] == ref
        assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] <= bad * 8  # cut at the bad page
    finally:
        for p in (lone_pre, lone_dec):
            assert p.stop() == 0, p.log()
        store.kill()
