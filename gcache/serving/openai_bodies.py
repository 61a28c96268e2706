"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from gcache.serving.openai_api import RequestKind
from gcache.serving.tiers import Tier

_PROCESS_TAG = secrets.token_hex(4)  # ids stay unique across workers and restarts


def response_id(kind: RequestKind, rid: int) -> str:
    return f"{'chatcmpl' if kind == RequestKind.CHAT else 'cmpl'}-{_PROCESS_TAG}{rid}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, cached_by_tier: Mapping[Tier, int]
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "cached_tokens_by_tier": dict(cached_by_tier)},
    }


def full_body(
    kind: RequestKind,
    rid_str: str,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    usage_: dict[str, Any],
    extras: dict[str, Any],
) -> dict[str, Any]:
    """The non-streamed answer. extras (ttft_ms, ...) go at the top level."""
    if kind == RequestKind.CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
            "token_ids": token_ids,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid_str,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_,
        **extras,
    }


class StreamChunks:
    """The chunks of one streamed answer (same id and `created` on every chunk)."""

    def __init__(self, kind: RequestKind, rid_str: str, model: str) -> None:
        self.kind, self.id, self.model = kind, rid_str, model
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == RequestKind.CHAT else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **more,
        }

    def role(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (OpenAI does); completions have none."""
        if self.kind != RequestKind.CHAT:
            return None
        return self._chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def text(self, piece: str, finish_reason: str | None = None) -> dict[str, Any]:
        if self.kind == RequestKind.CHAT:
            delta = {"content": piece} if piece else {}
            return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])
        return self._chunk([{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish_reason}])

    def usage(self, usage_: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([], usage=usage_)
