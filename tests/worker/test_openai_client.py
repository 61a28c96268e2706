"""The official `openai` client against a real gcache-worker: completions and chat, streamed and not,
usage with cached tokens, stop strings."""

from __future__ import annotations

import pytest

from gcache.serving.openai_api import CHAT_PATH, prompt_tokens
from gcache.serving.tokenizer import ByteTokenizer
from tests.support.serving_support import WorkerProc, openai_client, post_json

pytestmark = pytest.mark.process  # starts processes

openai = pytest.importorskip("openai")

TOK = ByteTokenizer(512)
PROMPT = "Streaming through the worker, token by token. "
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = WorkerProc(tmp_path_factory.mktemp("openai")).start()
    yield w
    assert w.stop() == 0, w.log()


@pytest.fixture(scope="module")
def client(worker):
    return openai_client(worker.url)


def raw_completion(worker, **payload) -> dict:
    status, body, _ = post_json(worker.port, "/v1/completions", payload)
    assert status == 200, body
    return body


def stop_in(token_ids: list[int]) -> tuple[str, int]:
    """A 2-byte printable stop string from the output, and where it first starts (>= 2)."""
    data = TOK.decode_bytes(token_ids)
    i = next(
        i
        for i in range(2, len(data) - 1)
        if all(32 <= b < 127 for b in data[i : i + 2]) and data.find(data[i : i + 2]) == i
    )
    return data[i : i + 2].decode(), i


def test_completions_create_plain_and_streamed_give_the_same_text(worker, client):
    ref = raw_completion(worker, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    text = ref["choices"][0]["text"]
    c = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, **GREEDY)
    assert c.choices[0].text == text and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(PROMPT), 24)
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=24, stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert len(chunks) > 2  # streamed as produced, not in one piece
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(ch.id == chunks[0].id for ch in chunks)


def test_streamed_usage_reports_cached_tokens_of_a_repeated_prompt(worker, client):
    prompt = "A prompt sent twice should be served from the cache the second time. " * 2
    first = list(
        client.completions.create(
            model="any", prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    second = list(
        client.completions.create(
            model="any", prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    plain = raw_completion(worker, prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True)
    for chunks in (first, second):
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt)
        assert chunks[-1].usage.completion_tokens == 4 and all(ch.usage is None for ch in chunks[:-1])
    assert first[-1].usage.prompt_tokens_details.cached_tokens == 0
    cached = second[-1].usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 8 == 0 and cached < len(prompt)
    assert cached == plain["usage"]["prompt_tokens_details"]["cached_tokens"]  # same rule streamed or not
    by_tier = second[-1].usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
    assert by_tier == {"l1": cached, "l2": 0, "l3": 0}


def test_chat_completions_plain_and_streamed(worker, client):
    ids = prompt_tokens(CHAT_PATH, {"messages": MESSAGES}, TOK)
    ref = raw_completion(worker, prompt=ids, max_tokens=20, temperature=0, ignore_eos=True)
    text = ref["choices"][0]["text"]  # the chat template's ids sent as a plain completion
    c = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=20, **GREEDY)
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == text
    assert c.choices[0].finish_reason == "length" and c.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model="any",
            messages=MESSAGES,
            max_completion_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 20


def test_stop_strings_cut_the_text_plain_and_streamed_without_leaking(worker, client):
    ref = raw_completion(worker, prompt=PROMPT, max_tokens=48, temperature=0, ignore_eos=True)
    stop, at = stop_in(ref["choices"][0]["token_ids"])
    expected = TOK.decode(ref["choices"][0]["token_ids"][:at])
    for stops in (stop, [stop, "never appears in the output"]):
        c = client.completions.create(model="any", prompt=PROMPT, max_tokens=48, stop=stops, **GREEDY)
        assert c.choices[0].text == expected and c.choices[0].finish_reason == "stop"
        assert c.usage.completion_tokens == at + 2  # it stopped on the token that completed the stop string
        chunks = list(
            client.completions.create(model="any", prompt=PROMPT, max_tokens=48, stop=stops, stream=True, **GREEDY)
        )
        pieces = [ch.choices[0].text for ch in chunks]
        assert "".join(pieces) == expected and chunks[-1].choices[0].finish_reason == "stop"
    raw = raw_completion(worker, prompt=PROMPT, max_tokens=48, temperature=0, ignore_eos=True, stop=stop)
    assert raw["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"][:at]
    # A stop string that never completes: everything held back is released at the end.
    c = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=48, stop=[stop + "\x00never"], stream=True, **GREEDY
    )
    assert "".join(ch.choices[0].text for ch in c) == ref["choices"][0]["text"]


def test_chat_stop_string(worker, client):
    ids = prompt_tokens(CHAT_PATH, {"messages": MESSAGES}, TOK)
    ref = raw_completion(worker, prompt=ids, max_tokens=40, temperature=0, ignore_eos=True)
    stop, at = stop_in(ref["choices"][0]["token_ids"])
    expected = TOK.decode(ref["choices"][0]["token_ids"][:at])
    c = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40, stop=[stop], **GREEDY)
    assert c.choices[0].message.content == expected and c.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40, stop=stop, stream=True, **GREEDY)
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_requests_raise_the_clients_error_with_the_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt="x", temperature=3)
    assert "temperature must be a number in [0, 2]" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=[{"role": "robot", "content": "x"}])
    assert "messages[0].role must be one of" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # a streamed request is validated before the stream opens
        list(client.completions.create(model="any", prompt="x", max_tokens=10_000, stream=True))
    assert "exceeds the limit 64" in str(e.value)
