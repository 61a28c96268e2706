"""OpenAI /v1/completions: request parsing/validation and the response body.

Accepted fields: prompt (text, or a list of token ids), max_tokens (default 16),
temperature (0..2, default 1.0; 0 = greedy), seed (int), ignore_eos (bool, default
false); model/user/stream=false/n=1/top_p=1/echo=false/logprobs=null are accepted as the
no-op they are here; anything we cannot honour (stream, n>1, stop strings, ...) is a 400
instead of being silently ignored.
"""
from __future__ import annotations

import json
import time

from .request import Request, SamplingParams
from .tokenizer import ByteTokenizer

NOOP_VALUES = {"stream": (False, None), "n": (1, None), "top_p": (1, 1.0, None), "echo": (False, None),
               "logprobs": (None,), "stop": (None, [], ""), "best_of": (1, None),
               "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None)}
FREE_FIELDS = {"model", "user"}
KNOWN = {"prompt", "max_tokens", "temperature", "seed", "ignore_eos"} | set(NOOP_VALUES) | FREE_FIELDS
SEED_MAX = (1 << 63) - 1


class CompletionError(ValueError):
    """A client error: the message says which field is wrong and why."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_completion(body: bytes, tok: ByteTokenizer) -> tuple[list[int], SamplingParams]:
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompletionError(f"body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise CompletionError("body must be a JSON object")
    unknown = sorted(set(req) - KNOWN)
    if unknown:
        raise CompletionError(f"unsupported field(s): {', '.join(unknown)}")
    for name, allowed in NOOP_VALUES.items():
        if name in req and not any(req[name] == a and type(req[name]) is type(a) for a in allowed):
            raise CompletionError(f"{name}={req[name]!r} is not supported by this worker")
    prompt = _parse_prompt(req, tok)
    max_tokens = req.get("max_tokens", 16)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise CompletionError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    temperature = req.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise CompletionError(f"temperature must be a number in [0, 2], got {temperature!r}")
    seed = req.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= SEED_MAX):
        raise CompletionError(f"seed must be an integer in [0, 2^63), got {seed!r}")
    ignore_eos = req.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise CompletionError(f"ignore_eos must be a boolean, got {ignore_eos!r}")
    stops = () if ignore_eos else (tok.eos_id,)
    return prompt, SamplingParams(max_tokens=max_tokens, temperature=float(temperature), seed=seed,
                                  stop_token_ids=stops)


def _parse_prompt(req: dict, tok: ByteTokenizer) -> list[int]:
    if "prompt" not in req:
        raise CompletionError("missing required field: prompt")
    prompt = req["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise CompletionError("prompt must not be empty")
        return tok.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise CompletionError("prompt must not be empty")
        if all(_is_int(t) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < tok.vocab_size]
            if bad:
                raise CompletionError(f"token id {bad[0]} out of range [0, {tok.vocab_size})")
            return list(prompt)
        if all(isinstance(t, (str, list)) for t in prompt):
            raise CompletionError("batched prompts (a list of prompts) are not supported; send one per request")
    raise CompletionError("prompt must be a string or a list of integer token ids")


def build_response(r: Request, tok: ByteTokenizer, model_name: str) -> dict:
    out = list(r.output)
    if out and r.finish_reason == "stop":
        out = out[:-1]  # the stop token is not part of the text (OpenAI)
    completion = len(r.output)
    ttft_ms = None if r.ttft_s is None else round(r.ttft_s * 1e3, 3)
    return {
        "id": f"cmpl-{r.rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "text": tok.decode(out), "token_ids": out, "logprobs": None,
                     "finish_reason": r.finish_reason}],
        "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": completion,
                  "total_tokens": len(r.prompt) + completion,
                  "prompt_tokens_details": {"cached_tokens": r.cached_tokens,
                                            "cached_tokens_by_tier": dict(r.cached_by_tier)}},
        "ttft_ms": ttft_ms,
        "e2e_ms": round((r.finished_s - r.arrival_s) * 1e3, 3),
        "preemptions": r.preemptions,
    }
