"""OpenAI requests: /v1/completions and /v1/chat/completions parsed into one ParsedRequest.

Fields honoured: prompt (text, or a list of token ids) | messages, max_tokens (chat also
max_completion_tokens; default 16), temperature (0..2, default 1.0; 0 = greedy), seed,
ignore_eos, stop (a string or a list of up to 16 strings), stream, stream_options
({"include_usage": bool}, only with stream=true). model and user are accepted and not
used; n=1, top_p=1, echo=false, logprobs=null, best_of=1 and zero penalties are accepted
as the no-ops they are here. Anything we cannot honour is a 400 naming the field, never
silently ignored.

Chat template (over the byte tokenizer; the model sees plain bytes plus <|bos|>):

    <|bos|>                               the BOS token (id 256), then the bytes of
    <|{role}|>\n{content}\n               one block per message, in order
    <|assistant|>\n                       where the model's answer starts

role is system, developer, user or assistant; content is a string or a list of
{"type": "text", "text": ...} parts (joined). The answer ends at <|eos|> (or a stop
string, or max_tokens). Example: [{"role": "user", "content": "Hi"}] becomes
[256] + bytes("<|user|>\nHi\n<|assistant|>\n").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeGuard

from gcache.serving.errors import HTTPError
from gcache.serving.tokenizer import ByteTokenizer


class RequestKind(enum.StrEnum):
    """Which OpenAI endpoint a request came through (its body's shape and its answer's)."""

    COMPLETION = "completion"  # /v1/completions: a prompt
    CHAT = "chat"  # /v1/chat/completions: messages, through the chat template


COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
KIND_BY_PATH = {COMPLETIONS_PATH: RequestKind.COMPLETION, CHAT_PATH: RequestKind.CHAT}

DEFAULT_MAX_TOKENS = 16
STOPS_MAX = 16
STOP_BYTES_MAX = 256
SEED_MAX = (1 << 63) - 1
CHAT_ROLES = ("system", "developer", "user", "assistant")

NOOP_VALUES = {
    "n": (1, None),
    "top_p": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
}
COMPLETION_NOOPS = {**NOOP_VALUES, "echo": (False, None), "logprobs": (None,), "best_of": (1, None)}
CHAT_NOOPS = {**NOOP_VALUES, "logprobs": (False, None), "top_logprobs": (None,)}
COMMON = {"max_tokens", "temperature", "seed", "ignore_eos", "stop", "stream", "stream_options", "model", "user"}
KNOWN = {
    RequestKind.COMPLETION: COMMON | {"prompt"} | set(COMPLETION_NOOPS),
    RequestKind.CHAT: COMMON | {"messages", "max_completion_tokens"} | set(CHAT_NOOPS),
}


@dataclass(frozen=True)
class ParsedRequest:
    kind: RequestKind
    prompt: list[int]  # exactly the token ids the model runs (chat: template applied)
    max_tokens: int
    temperature: float
    seed: int | None
    ignore_eos: bool
    stop: tuple[str, ...]  # stop strings: the output is cut before the first one found
    stream: bool
    include_usage: bool  # stream: a last chunk carries usage
    model: str | None


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_request(path: str, payload: object, tokenizer: ByteTokenizer) -> ParsedRequest:
    """Validate an OpenAI body for `path`; HTTPError(400) names the field that is wrong."""
    kind = KIND_BY_PATH.get(path)
    if kind is None:
        raise HTTPError(404, f"no such endpoint: POST {path}")
    if not isinstance(payload, dict):
        raise HTTPError(400, "body must be a JSON object")
    unknown = sorted(set(payload) - KNOWN[kind])
    if unknown:
        raise HTTPError(400, f"unsupported field(s): {', '.join(unknown)}")
    for name, allowed in (COMPLETION_NOOPS if kind is RequestKind.COMPLETION else CHAT_NOOPS).items():
        v = payload.get(name, allowed[0])
        if not any(v == a and type(v) is type(a) for a in allowed):
            raise HTTPError(400, f"{name}={v!r} is not supported by this worker")
    prompt = (
        completion_prompt(payload, tokenizer) if kind is RequestKind.COMPLETION else chat_prompt(payload, tokenizer)
    )
    stream = payload.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise HTTPError(400, f"stream must be a boolean, got {stream!r}")
    return ParsedRequest(
        kind=kind,
        prompt=prompt,
        max_tokens=_max_tokens(payload, kind),
        temperature=_temperature(payload),
        seed=_seed(payload),
        ignore_eos=_bool(payload, "ignore_eos"),
        stop=parse_stop(payload.get("stop")),
        stream=stream,
        include_usage=_include_usage(payload, stream),
        model=payload.get("model") if isinstance(payload.get("model"), str) else None,
    )


def prompt_tokens(path: str, payload: object, tokenizer: ByteTokenizer) -> list[int]:
    """The exact prompt token ids the worker runs for this body (the router routes on them)."""
    return parse_request(path, payload, tokenizer).prompt


# ---- prompt ------------------------------------------------------------------------------
def completion_prompt(payload: dict[str, Any], tok: ByteTokenizer) -> list[int]:
    if "prompt" not in payload:
        raise HTTPError(400, "missing required field: prompt")
    prompt = payload["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise HTTPError(400, "prompt must not be empty")
        return _encode(tok, prompt, "prompt")
    if isinstance(prompt, list):
        if not prompt:
            raise HTTPError(400, "prompt must not be empty")
        if all(_is_int(t) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise HTTPError(400, f"token id {bad} out of range [0, {tok.vocab_size})")
            return list(prompt)
        if all(isinstance(t, (str, list)) for t in prompt):
            raise HTTPError(400, "batched prompts (a list of prompts) are not supported; send one per request")
    raise HTTPError(400, "prompt must be a string or a list of integer token ids")


def chat_prompt(payload: dict[str, Any], tok: ByteTokenizer) -> list[int]:
    """The chat template (module docstring) applied to `messages`."""
    messages = payload.get("messages")
    if messages is None:
        raise HTTPError(400, "missing required field: messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list of {role, content} objects")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HTTPError(400, f"messages[{i}] must be an object")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise HTTPError(400, f"messages[{i}]: unsupported field(s): {', '.join(extra)}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise HTTPError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        parts.append(f"<|{role}|>\n{_content(m.get('content'), i)}\n")
    parts.append("<|assistant|>\n")
    return [tok.bos_id] + _encode(tok, "".join(parts), "messages")


def _content(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
                and set(part) <= {"type", "text"}
            ):
                raise HTTPError(
                    400,
                    f'messages[{i}].content[{j}] must be {{"type": "text", "text": str}} '
                    "(only text parts are supported)",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise HTTPError(400, f"messages[{i}].content must be a string or a list of text parts")


def _encode(tok: ByteTokenizer, text: str, field: str) -> list[int]:
    try:
        return tok.encode(text)
    except UnicodeEncodeError as e:  # a lone surrogate that reached us without safe_json
        raise HTTPError(400, f"{field} is not valid Unicode (lone surrogate at index {e.start})") from None


# ---- sampling and stream options ---------------------------------------------------------------
def _max_tokens(payload: dict[str, Any], kind: RequestKind) -> int:
    name = (
        "max_completion_tokens"
        if kind is RequestKind.CHAT and payload.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    v = payload.get(name)
    if v is None:
        return DEFAULT_MAX_TOKENS
    if not _is_int(v) or v < 1:
        raise HTTPError(400, f"{name} must be an integer >= 1, got {v!r}")
    return v


def _temperature(payload: dict[str, Any]) -> float:
    t = payload.get("temperature")
    if t is None:
        return 1.0
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2:
        raise HTTPError(400, f"temperature must be a number in [0, 2], got {t!r}")
    return float(t)


def _seed(payload: dict[str, Any]) -> int | None:
    seed = payload.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= SEED_MAX):
        raise HTTPError(400, f"seed must be an integer in [0, 2^63), got {seed!r}")
    return seed


def _bool(payload: dict[str, Any], name: str) -> bool:
    v = payload.get(name, False)
    if not isinstance(v, bool):
        raise HTTPError(400, f"{name} must be a boolean, got {v!r}")
    return v


def parse_stop(stop: object) -> tuple[str, ...]:
    if stop is None or stop == "" or stop == []:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise HTTPError(400, "stop must be a string or a list of non-empty strings")
    if len(stops) > STOPS_MAX:
        raise HTTPError(400, f"stop has {len(stops)} strings; at most {STOPS_MAX} are supported")
    for s in stops:
        try:
            size = len(s.encode("utf-8"))
        except UnicodeEncodeError:
            raise HTTPError(400, "stop strings must be valid Unicode") from None
        if size > STOP_BYTES_MAX:
            raise HTTPError(400, f"a stop string is {size} bytes; the limit is {STOP_BYTES_MAX}")
    return tuple(dict.fromkeys(stops))


def _include_usage(payload: dict[str, Any], stream: bool) -> bool:
    opts = payload.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise HTTPError(400, "stream_options is only allowed with stream=true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise HTTPError(400, 'stream_options must be {"include_usage": true|false}')
    v = opts.get("include_usage", False)
    if not isinstance(v, bool):
        raise HTTPError(400, f"stream_options.include_usage must be a boolean, got {v!r}")
    return v
