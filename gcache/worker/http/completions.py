"""OpenAI requests on the engine: SamplingParams from a parsed body, the answer from a finished Request.

Parsing and validation live in gcache.serving.openai_api (shared with the router); the
text a client sees (stop strings, UTF-8) in gcache.serving.stop_text.
"""

from __future__ import annotations

from typing import Any

from gcache.serving import openai_bodies
from gcache.serving.openai_api import ParsedRequest, RequestKind
from gcache.serving.stop_text import OutputText
from gcache.serving.tokenizer import ByteTokenizer
from gcache.worker.engine.request import FINISH_STOP, FinishReason, Request, SamplingParams


def sampling_params(parsed: ParsedRequest, tok: ByteTokenizer) -> SamplingParams:
    stops = () if parsed.ignore_eos else (tok.eos_id,)
    return SamplingParams(
        max_tokens=parsed.max_tokens, temperature=parsed.temperature, seed=parsed.seed, stop_token_ids=stops
    )


def finish_reason(r: Request, out: OutputText) -> FinishReason:
    if r.finish_reason is None:  # cannot happen: r finished
        raise RuntimeError("invariant broken: r finished")
    return FINISH_STOP if out.stopped else r.finish_reason


def output_ids(r: Request, out: OutputText) -> list[int]:
    """The generated ids the text stands for: cut before a stop string; without a stop token."""
    if out.stopped:
        return list(r.output[: out.kept_tokens()])
    if r.finish_reason == FINISH_STOP and r.output:
        return list(r.output[:-1])  # the stop token is not part of the text (OpenAI)
    return list(r.output)


def usage(r: Request) -> dict[str, Any]:
    return openai_bodies.usage(len(r.prompt), len(r.output), r.cached_tokens, r.cached_by_tier)


def extras(r: Request) -> dict[str, Any]:
    """Worker-specific fields beside OpenAI's: timings and preemptions."""
    if r.finished_s is None:  # cannot happen: r finished
        raise RuntimeError("invariant broken: r finished")
    return {
        "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1e3, 3),
        "e2e_ms": round((r.finished_s - r.arrival_s) * 1e3, 3),
        "preemptions": r.preemptions,
    }


def full_response(kind: RequestKind, r: Request, out: OutputText, model_name: str) -> dict[str, Any]:
    return openai_bodies.full_body(
        kind,
        openai_bodies.response_id(kind, r.rid),
        model_name,
        out.text,
        output_ids(r, out),
        finish_reason(r, out),
        usage(r),
        extras(r),
    )
