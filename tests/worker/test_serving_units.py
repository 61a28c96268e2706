"""gcache.serving pieces on their own: stop strings and hold-back, safe JSON, OpenAI parsing, chat template."""

from __future__ import annotations

import json

import pytest

from gcache.serving.errors import HTTPError
from gcache.serving.openai_api import CHAT_PATH, COMPLETIONS_PATH, parse_request, prompt_tokens
from gcache.serving.safe_json import parse_json
from gcache.serving.sse import parse_events
from gcache.serving.stop_text import OutputText
from gcache.serving.tokenizer import ByteTokenizer

TOK = ByteTokenizer(512)


def feed_bytes(out: OutputText, data: bytes) -> list[str]:
    return [out.feed([b]) for b in data]


# ---- stop strings ------------------------------------------------------------------------------
def test_stop_string_cuts_before_it_and_never_leaks_a_prefix():
    out = OutputText(TOK, ("STOP",))
    pieces = feed_bytes(out, b"ab ST x STO") + [out.feed(TOK.encode("P tail"))]
    # "ST" is held while it could start "STOP", released when " " shows it does not;
    # "STO" is held until "P" completes the stop string, then never sent.
    assert pieces == ["a", "b", " ", "", "", "ST ", "x", " ", "", "", "", ""]
    assert out.stopped and out.text == "ab ST x " and out.kept_tokens() == 8 and out.num_tokens == 17
    assert out.feed(TOK.encode("more")) == "" and out.finish() == ""


def test_earliest_of_several_stops_wins_and_held_text_is_released_at_the_end():
    out = OutputText(TOK, ("xyz", "yz", "q"))
    assert "".join(feed_bytes(out, b"1xy")) == "1"  # "xy" could start "xyz"
    assert out.feed(TOK.encode("z")) == ""  # "xyz" at 1 starts before "yz" at 2
    assert out.text == "1" and out.kept_tokens() == 1
    out = OutputText(TOK, ("xyz",))
    assert "".join(feed_bytes(out, b"abxy")) == "ab"
    assert out.finish() == "xy" and out.text == "abxy" and not out.stopped


def test_multibyte_characters_arrive_whole_and_special_tokens_are_silent():
    text = "héllo €, 日本"
    out = OutputText(TOK)
    pieces = [out.feed([b]) for b in text.encode()] + [out.feed([TOK.eos_id]), out.finish()]
    assert "".join(pieces) == text
    assert all(p == "" or "\ufffd" not in p for p in pieces)
    assert pieces[1:3] == ["", "é"]  # the first byte of "é" waits for the second
    out = OutputText(TOK, ("€",))
    assert "".join(feed_bytes(out, text.encode())) == "héllo " and out.stopped
    assert out.kept_tokens() == len("héllo ".encode())


def test_invalid_utf8_is_replaced_the_same_streamed_or_whole():
    data = b"a\xffb\xe2\x82c"
    out = OutputText(TOK)
    streamed = "".join(feed_bytes(out, data)) + out.finish()
    assert streamed == data.decode("utf-8", errors="replace") == "a\ufffdb\ufffdc"


# ---- safe JSON ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, fragment",
    [
        (b'{"prompt": "ab\\ud800cd"}', "lone surrogate"),
        (b'{"ab\\udfffcd": 1}', "lone surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
        (b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", "nested deeper than 32"),
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
        (b'{"x": NaN}', "NaN is not valid JSON"),
        (b'{"x": -Infinity}', "-Infinity is not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_parse_json_answers_400_for_what_json_loads_lets_through_or_crashes_on(body, fragment):
    with pytest.raises(HTTPError) as e:
        parse_json(body)
    assert e.value.status == 400 and fragment in e.value.message


def test_parse_json_keeps_valid_surrogate_pairs_and_moderate_nesting():
    assert parse_json(b'{"prompt": "smile \\ud83d\\ude00"}') == {"prompt": "smile \U0001f600"}
    nested = b"[" * 32 + b"]" * 32
    assert parse_json(nested) == json.loads(nested)
    assert parse_json(json.dumps({"prompt": list(range(50_000))}).encode())["prompt"][-1] == 49_999


# ---- OpenAI parsing -----------------------------------------------------------------------------------
def test_chat_template_exact_ids():
    payload = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
        ]
    }
    ids = prompt_tokens(CHAT_PATH, payload, TOK)
    assert ids == [256] + list(b"<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n")


def test_parse_request_fields_and_defaults():
    p = parse_request(
        COMPLETIONS_PATH, {"prompt": "hi", "stop": "\n", "stream": True, "stream_options": {"include_usage": True}}, TOK
    )
    assert (p.kind, p.prompt, p.max_tokens, p.temperature, p.seed, p.stop, p.stream, p.include_usage) == (
        "completion",
        [104, 105],
        16,
        1.0,
        None,
        ("\n",),
        True,
        True,
    )
    p = parse_request(
        CHAT_PATH,
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "temperature": 0,
            "stop": ["a", "b", "a"],
        },
        TOK,
    )
    assert (p.kind, p.max_tokens, p.temperature, p.stop, p.stream) == ("chat", 5, 0.0, ("a", "b"), False)
    assert parse_request(COMPLETIONS_PATH, {"prompt": [1, 2, 3], "stop": None}, TOK).prompt == [1, 2, 3]


@pytest.mark.parametrize(
    "path, payload, fragment",
    [
        (CHAT_PATH, {}, "missing required field: messages"),
        (CHAT_PATH, {"messages": []}, "non-empty list"),
        (CHAT_PATH, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": "x", "name": "n"}]}, "unsupported field(s): name"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": 5}]}, "must be a string or a list"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "tools": []}, "unsupported field(s): tools"),
        (COMPLETIONS_PATH, {"prompt": "x", "stop": ["a", ""]}, "non-empty strings"),
        (COMPLETIONS_PATH, {"prompt": "x", "stop": 5}, "stop must be a string or a list"),
        (COMPLETIONS_PATH, {"prompt": "x", "stop": ["s"] * 17}, "at most 16"),
        (COMPLETIONS_PATH, {"prompt": "x", "stop": "s" * 257}, "the limit is 256"),
        (COMPLETIONS_PATH, {"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, "stream_options must be"),
        (COMPLETIONS_PATH, {"prompt": "ab\ud800cd"}, "lone surrogate"),
        (COMPLETIONS_PATH, [1], "JSON object"),
    ],
)
def test_parse_request_rejects_with_the_field_named(path, payload, fragment):
    with pytest.raises(HTTPError) as e:
        parse_request(path, payload, TOK)
    assert e.value.status == 400 and fragment in e.value.message


def test_sse_parse_events_round_trip():
    raw = b'data: {"a":1}\n\ndata: {"b":"x\\ny"}\n\ndata: [DONE]\n\n'
    assert parse_events(raw) == [{"a": 1}, {"b": "x\ny"}, "[DONE]"]
