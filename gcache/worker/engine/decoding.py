"""How the engine turns a forward into tokens: the decoding-strategy contract and plain decoding.

A strategy proposes what a step computes (decode_tokens, forward) and verifies what the
forward gave (verify -> Verdict: the tokens it vouches for). It never appends tokens,
finishes requests, writes to the cache or frees pages: the engine's commit (Engine.step)
appends a verdict's tokens, cuts them at a stop token or max_tokens, shrinks the request's
KV to what was accepted (RequestKV.shrink), applies the write cadence, TTFT and the finish
rules, then calls after_commit so the strategy can prepare the next step (drafts).

PlainDecoding: one token per decoding request, sampled from the last position's logits.
Speculative decoding with the model's MTP blocks: speculative.MTPSpeculator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.worker import backend
from gcache.worker.engine.request import Request

if TYPE_CHECKING:
    from gcache.worker.engine.metrics import EngineMetrics
    from gcache.worker.kvcache.cache_manager import CacheManager
    from gcache.worker.kvcache.kv_pool import DualKVCache
    from gcache.worker.model.base import BatchModel

LayerReady = Callable[[int], None]


@dataclass(frozen=True)
class DecodingContext:
    """The engine's parts a strategy may use (Engine(decoding=...) builds one from it)."""

    model: BatchModel
    kv: DualKVCache
    cache: CacheManager
    metrics: EngineMetrics


@dataclass(frozen=True)
class Verdict:
    """What one request's forward gave, as its strategy vouches for it.

    computed: positions of committed tokens the forward computed (the chunk less the drafts
    it carried); tokens: the tokens to emit, in order (empty: mid-prefill, nothing to
    sample); rows: each token's logits row (numpy), for Request.logits; drafted / accepted:
    the drafts the chunk carried and how many of them the forward confirmed (0 / 0 plainly).
    """

    computed: int
    tokens: list[int] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class Committed:
    """What the engine's commit made of a Verdict (after_commit's argument).

    emitted: the verdict's tokens appended (a stop token or max_tokens cuts the rest);
    output_before: len(r.output) before them; wrote: the cache took r's pages in this commit
    (the write cadence); finishing: r finishes right after after_commit returns.
    """

    emitted: int
    output_before: int
    wrote: bool
    finishing: bool


def sample_token(row: np.ndarray, r: Request) -> int:
    """The token drawn from one logits row: argmax at temperature 0, else one draw of r.rng
    (the only thing that advances it; a PD handoff replays one draw per handed token)."""
    t = float(r.params.temperature)
    if t == 0.0:
        return int(np.argmax(row))
    z = row.astype(np.float64) / t
    p = np.exp(z - z.max())
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, r.rng.random() * cdf[-1], side="right"), row.size - 1))


class DecodingStrategy(ABC):
    """What runs for the requests of one step, and which of the resulting tokens count.

    Called on the engine thread only: decode_tokens / drop_drafts while the batch is
    planned, forward once per step, verify then after_commit per request of the batch,
    forget when a request leaves the running list (finished, preempted, aborted)."""

    def decode_tokens(self, r: Request) -> int:
        """Positions a decoding request runs this step (its last token, plus any drafts)."""
        return 1

    def drop_drafts(self, r: Request) -> None:
        """The pools have no room for r's drafts this step: it decodes one token plainly."""

    @abstractmethod
    def forward(self, batch: list[tuple[Request, int]], kv: DualKVCache, layer_ready: LayerReady | None) -> list[Any]:
        """One forward over every (request, positions) of the batch; one output per request
        (whatever verify takes). The requests' pages already cover their positions."""

    @abstractmethod
    def verify(self, r: Request, n: int, out: Any) -> Verdict:
        """r's part of the forward (n positions, now computed) as a Verdict. Must not
        change r's tokens, pages or state: the engine commits what it returns."""

    def after_commit(self, r: Request, out: Any, verdict: Verdict, committed: Committed) -> None:
        """The engine appended `committed.emitted` of the verdict's tokens (and r's KV was
        shrunk to match); prepare r's next step. If committed.finishing, r finishes next."""

    def forget(self, r: Request) -> None:
        """r leaves the running list: drop whatever the strategy keeps for it."""


class PlainDecoding(DecodingStrategy):
    """One token per decoding request: the model's logits at the chunk's last position."""

    def __init__(self, ctx: DecodingContext) -> None:
        self.model = ctx.model

    def forward(self, batch: list[tuple[Request, int]], kv: DualKVCache, layer_ready: LayerReady | None) -> list[Any]:
        work = [(r.token_slice(r.num_computed, r.num_computed + n), None, r.held_kv) for r, n in batch]
        return self.model.forward_batch(work, kv, layer_ready=layer_ready)

    def verify(self, r: Request, n: int, out: Any) -> Verdict:
        if r.num_computed < r.num_tokens:
            return Verdict(computed=n)  # mid-prefill: nothing to sample yet
        row = backend.to_numpy(out)[-1]
        return Verdict(computed=n, tokens=[sample_token(row, r)], rows=[row])
