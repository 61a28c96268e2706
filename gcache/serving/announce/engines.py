"""What a registration says beyond gcache.serving.redis_layout's fields: the engine behind it.

A `gcache-router kv-events` translator registers a vLLM server with the same registration
JSON a gcache-worker writes, plus an "engine" object the routers read (older routers and the
layout's parser ignore unknown keys):

  "engine": {"kind": "vllm", "models": ["served-name", ...], "bucket": 1, "l3": true}

kind    "vllm" (tokenize with the model's own tokenizer, honour the request's model); absent:
        the bundled gcache-worker (byte tokenizer, any model name)
models  the names the server answers to (its /v1/models)
bucket  the --length-buckets group it serves (absent: the router spreads workers over them)
l3      it loads GCache's shared L3 through the connector (tier-aware scoring credits L3)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from gcache.serving.redis_layout import REGISTRATION_BYTES_MAX


class EngineKind(StrEnum):
    """Who answers at a registered URL (the registration's "engine" kind)."""

    GCACHE_WORKER = ""  # the bundled gcache-worker: byte tokenizer, any model name
    VLLM = "vllm"  # a vLLM OpenAI server: its model's tokenizer, the request's model honoured


KINDS = tuple(k.value for k in EngineKind)
MODELS_MAX = 16
NAME_CHARS_MAX = 256
BUCKETS_MAX = 64


@dataclass(frozen=True)
class EngineInfo:
    kind: EngineKind = EngineKind.GCACHE_WORKER
    models: tuple[str, ...] = ()
    bucket: int | None = None
    l3: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", EngineKind(self.kind))  # ValueError for an unknown kind

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"kind": self.kind.value, "models": list(self.models)}
        if self.bucket is not None:
            d["bucket"] = self.bucket
        if self.l3:
            d["l3"] = True
        return d


GCACHE_WORKER = EngineInfo()


def parse_info(raw: bytes) -> EngineInfo:
    """The engine object of a registration (GCACHE_WORKER when absent or malformed)."""
    if len(raw) > REGISTRATION_BYTES_MAX:
        return GCACHE_WORKER
    try:
        d = json.loads(raw).get("engine")
    except (ValueError, AttributeError, RecursionError):
        return GCACHE_WORKER
    if not isinstance(d, dict) or d.get("kind") not in KINDS:
        return GCACHE_WORKER
    models = d.get("models") or ()
    if not isinstance(models, list):
        models = []
    names = tuple(m for m in models[:MODELS_MAX] if isinstance(m, str) and 0 < len(m) <= NAME_CHARS_MAX)
    bucket = d.get("bucket")
    if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 <= bucket < BUCKETS_MAX:
        bucket = None
    return EngineInfo(EngineKind(d["kind"]), names, bucket, d.get("l3") is True)


def with_info(reg_json: bytes, info: EngineInfo, extra: dict[str, object] | None = None) -> bytes:
    """A registration's JSON with the engine object (and `extra` keys, e.g. the translator's
    counters, for people and tools: routers read only "engine") added."""
    d = json.loads(reg_json)
    d.update(extra or {})
    d["engine"] = info.to_dict()
    return json.dumps(d, separators=(",", ":")).encode()
