"""Prefill/decode disaggregation: worker roles, the endpoints, and the handoff record.

A prefill worker computes a prompt and its first token, writes the prompt's KV to L3 (full
pages, plus the SWA window tail of the prompt's end) and answers with a Handoff. A decode
worker takes the same OpenAI body plus that record, admits it as an L3 hit (host slots
while the pages are read, device pages when it is scheduled) and generates the rest.

The record names pages by the SGLang page-hash chain of the prompt. A decode worker never
reads a key because the record says so: it recomputes the chain from the request's own
tokens and refuses a record whose keys, model or geometry differ (validate()). Its L3 keys
carry its own model name and its store connection its own tenant, so no record can make it
read another model's or tenant's pages.

Pools: `pools` maps a KV pool to the page range [lo, hi) the prefill stored for it ("full":
every whole page of the prompt; "swa": the window tail of its end). A later pool (an MTP
draft head's KV, say "mtp") is one more entry with its own range; a decoder that does not
know a pool refuses the record (a clear 400, never a silent partial load).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from gcache.common.attention import AttentionKind
from gcache.serving.errors import HTTPError
from gcache.serving.swa_window import tail_start_page
from gcache.wire.keys import page_hashes_array

HANDOFF_VERSION = 1
PD_PREFILL_PATH = "/pd/prefill"
PD_DECODE_PATH = "/pd/decode"
KNOWN_POOLS = (AttentionKind.FULL, AttentionKind.SWA)  # add "mtp" here (and in the decoder) when MTP KV travels too
PAGES_MAX = 1 << 20  # a record naming more pages than this is refused (a bound, not a real size)


class Role(enum.StrEnum):
    """What a worker does (gcache-worker --role); routers pool workers by it."""

    MIXED = "mixed"  # prefill and decode (today's worker)
    PREFILL = "prefill"  # prompts and first tokens; answers /pd/prefill with a Handoff
    DECODE = "decode"  # continues handoffs (/pd/decode); also serves plain requests (fallback)

    def serves_prefill(self) -> bool:
        return self in (Role.MIXED, Role.PREFILL)

    def serves_decode(self) -> bool:
        return self in (Role.MIXED, Role.DECODE)


ROLES = tuple(r.value for r in Role)


@dataclass(frozen=True)
class Handoff:
    model: str  # the prefill worker's --model-name (its L3 key suffix)
    page_size: int
    window: int
    prompt_tokens: int
    first_token: int  # sampled by the prefill worker; the decode worker continues after it
    sampled: int  # tokens sampled so far (the decoder advances its RNG this many times)
    pages: tuple[str, ...]  # page hashes of every whole page of the prompt, in order
    pools: dict[str, tuple[int, int]]  # pool -> [lo, hi): pages of `pages` whose KV of that pool went to L3
    stored_pages: int  # leading pages known to be in L3 when the prefill answered
    response_id: str  # the id every chunk of the client's answer carries
    created: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": HANDOFF_VERSION,
            "model": self.model,
            "page_size": self.page_size,
            "window": self.window,
            "prompt_tokens": self.prompt_tokens,
            "first_token": self.first_token,
            "sampled": self.sampled,
            "pages": list(self.pages),
            "pools": {k: list(v) for k, v in self.pools.items()},
            "stored_pages": self.stored_pages,
            "response_id": self.response_id,
            "created": self.created,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: object) -> Handoff:
        """Shape checks only; HTTPError(400) for anything malformed."""
        if not isinstance(d, dict) or d.get("v") != HANDOFF_VERSION:
            raise HTTPError(400, f"handoff: expected an object with v={HANDOFF_VERSION}")
        try:
            pages = d["pages"]
            pools = d["pools"]
            if not isinstance(pages, list) or len(pages) > PAGES_MAX or not all(isinstance(p, str) for p in pages):
                raise ValueError("pages must be a list of page hashes")
            if not isinstance(pools, dict):
                raise ValueError("pools must be an object")
            unknown = sorted(set(pools) - set(KNOWN_POOLS))
            if unknown:
                raise ValueError(f"unknown KV pool(s) {unknown} (this worker knows {list(KNOWN_POOLS)})")
            ranges = {}
            for k, v in pools.items():
                lo, hi = (int(x) for x in v)
                if not 0 <= lo <= hi <= len(pages):
                    raise ValueError(f"pool {k} range [{lo}, {hi}) outside the {len(pages)} pages")
                ranges[k] = (lo, hi)
            h = cls(
                model=str(d["model"]),
                page_size=int(d["page_size"]),
                window=int(d["window"]),
                prompt_tokens=int(d["prompt_tokens"]),
                first_token=int(d["first_token"]),
                sampled=int(d["sampled"]),
                pages=tuple(pages),
                pools=ranges,
                stored_pages=int(d["stored_pages"]),
                response_id=str(d["response_id"])[:200],
                created=int(d["created"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HTTPError(400, f"handoff: malformed record: {e}") from None
        if h.page_size < 1 or h.prompt_tokens < 1 or h.sampled != 1 or not 0 <= h.stored_pages <= len(h.pages):
            raise HTTPError(400, "handoff: page_size, prompt_tokens, sampled or stored_pages out of range")
        return h

    def validate(self, model: str, page_size: int, window: int, prompt: list[int], vocab_size: int) -> None:
        """The record must describe exactly this request on this model: HTTPError(400) if not."""
        if self.model != model:
            raise HTTPError(400, f"handoff is for model {self.model!r}; this worker serves {model!r}")
        if (self.page_size, self.window) != (page_size, window):
            raise HTTPError(400, "handoff page size / window differ from this worker's")
        if self.prompt_tokens != len(prompt):
            raise HTTPError(400, f"handoff is for a {self.prompt_tokens}-token prompt; this one has {len(prompt)}")
        if not 0 <= self.first_token < vocab_size:
            raise HTTPError(400, f"handoff first_token {self.first_token} outside the vocabulary")
        want = expected_pools(len(prompt), page_size, window)
        if len(self.pages) != want[AttentionKind.FULL][1] or page_hashes_array(prompt, page_size) != list(self.pages):
            raise HTTPError(400, "handoff pages do not match the prompt's page-hash chain (another prompt's pages)")
        if self.pools.get(AttentionKind.FULL) != want[AttentionKind.FULL]:
            raise HTTPError(400, "handoff full pool must cover every whole page of the prompt")


def expected_pools(prompt_tokens: int, page_size: int, window: int) -> dict[str, tuple[int, int]]:
    """What a prefill stores: every whole page's full KV; the SWA of its end's window tail."""
    n = prompt_tokens // page_size
    return {AttentionKind.FULL: (0, n), AttentionKind.SWA: (tail_start_page(n, page_size, window), n)}


def parse_pd_body(payload: object, need_handoff: bool) -> tuple[str, dict[str, Any], Handoff | None]:
    """A /pd/* body: {"path": "/v1/completions" | "/v1/chat/completions", "request": {OpenAI
    body}, "handoff": {...} (decode only)} -> (path, request, handoff)."""
    if not isinstance(payload, dict):
        raise HTTPError(400, "body must be a JSON object")
    path, req = payload.get("path"), payload.get("request")
    if not isinstance(path, str) or not isinstance(req, dict):
        raise HTTPError(400, 'a /pd/ body needs "path" (the OpenAI endpoint) and "request" (its body)')
    handoff = Handoff.from_dict(payload.get("handoff")) if need_handoff else None
    return path, req, handoff
