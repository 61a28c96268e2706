"""One generation request: tokens, sampling parameters, KV page ownership, timestamps.

Page ownership (the rule that keeps the pools leak-free): pages [0, borrowed_pages) of
`kv` belong to the prefix tree and are protected by the lock on `lock_node`; the request
never frees them. Every other page in `kv` was allocated by the request and is freed by
it, or handed to the tree with `insert` (which takes ownership).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gcache.serving.tiers import TIERS
from gcache.wire.keys import page_hashes_array
from gcache.worker.kvcache.kv_pool import RequestKV

if TYPE_CHECKING:
    from gcache.worker.kvcache.swa_tree.node import TreeNode
    from gcache.worker.kvcache.tiers.l3_store import Prefetch
    from gcache.worker.model.mtp import MTPState


class FinishReason(enum.StrEnum):
    """Why a request finished: OpenAI's finish_reason strings (the values go into the JSON)."""

    LENGTH = "length"  # max_tokens reached (OpenAI's name)
    STOP = "stop"  # a stop token was sampled, or a stop string appeared
    ABORT = "abort"  # the engine gave up on it (shutdown, cannot fit, cancelled)


FINISH_LENGTH = FinishReason.LENGTH
FINISH_STOP = FinishReason.STOP
FINISH_ABORT = FinishReason.ABORT

_rid_counter = itertools.count(1)


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy argmax
    seed: int | None = None  # per-request RNG seed for temperature > 0 (None -> rid)
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")


class Request:
    """State of one sequence through waiting -> running (-> waiting if preempted) -> finished."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        arrival_s: float,
        record_logits: bool = False,
        page_size: int = 16,
    ) -> None:
        if len(prompt) < 1:
            raise ValueError("prompt must have at least one token")
        self.rid = next(_rid_counter)
        self.page_size = page_size
        self.prompt = np.asarray(prompt, dtype=np.int64)
        self.output: list[int] = []
        self.params = params
        self.state = RequestState.WAITING
        seed = params.seed if params.seed is not None else self.rid
        self.rng = np.random.default_rng(seed)  # advanced only by sampling: preemption-safe
        # KV state (None while waiting). kv.full_pages / kv.swa_pages, one entry per page.
        # kv.owned_from = leading pages owned by the tree (locked via lock_node);
        # kv.num_tokens = tokens whose K/V are written.
        self.kv: RequestKV | None = None
        self.lock_node: TreeNode | None = None
        self.prefix_cached = False  # this admission's prefill already handed to the tree
        self._page_keys: list[str] = []  # page-hash chain of tokens(), grown on demand
        self.branch_page = 0  # where this request's tokens leave the cached tree (pages)
        self.prefetch: Prefetch | None = None  # L3 prefetch handle while waiting (hierarchy)
        self.prefetch_tried = False
        # Speculative decoding (engine/speculative.py): next step's MTP drafts, their logits
        # rows (temperature > 0), and the MTP KV (model/mtp.MTPState) while running.
        self.draft: list[int] = []
        self.draft_rows: list[np.ndarray] = []
        self.mtp: MTPState | None = None
        # Accounting.
        self.cached_tokens = 0  # prefix hit at first admission (usage.cached_tokens)
        self.cached_by_tier = dict.fromkeys(TIERS, 0)  # split of cached_tokens
        self.preemptions = 0
        self.arrival_s = arrival_s
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.logits: list[np.ndarray] | None = [] if record_logits else None
        # Scheduler cache: uncached-token estimate and the tree epoch it was computed at.
        self.uncached_estimate = len(prompt)
        self.estimate_epoch = -1

    # ---- token views -----------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, end: int | None = None) -> np.ndarray:
        """prompt + output, optionally cut at `end` (no copy when within the prompt)."""
        end = self.num_tokens if end is None else end
        if end <= len(self.prompt):
            return self.prompt[:end]
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int64)])[:end]

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """tokens()[start:end] without building the whole sequence (decode reads one id)."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return np.asarray(self.output[start - n : end - n], dtype=np.int64)
        return np.concatenate([self.prompt[start:], np.asarray(self.output[: end - n], dtype=np.int64)])

    def page_keys(self, num_pages: int | None = None) -> list[str]:
        """The SGLang page-hash chain of the first num_pages whole pages of tokens() (default:
        all whole pages). Tokens only grow, so the chain is extended, never recomputed."""
        ps = self.page_size
        whole = self.num_tokens // ps
        n = whole if num_pages is None else num_pages
        if not 0 <= n <= whole:
            raise ValueError(f"page_keys: {n} pages asked, {whole} whole pages exist")
        have = len(self._page_keys)
        if n > have:
            prior = self._page_keys[-1] if have else None
            self._page_keys += page_hashes_array(self.token_slice(have * ps, n * ps), ps, prior)
        return self._page_keys[:n]

    @property
    def num_computed(self) -> int:
        return 0 if self.kv is None else self.kv.num_tokens

    @property
    def borrowed_pages(self) -> int:
        return 0 if self.kv is None else self.kv.owned_from

    @property
    def held_kv(self) -> RequestKV:
        """`kv` of a request that holds pages (admitted: running, or finishing in this step);
        only the engine and the cache read it, and only then."""
        if self.kv is None:
            raise RuntimeError(f"{self} holds no KV pages")
        return self.kv

    @property
    def to_compute(self) -> int:
        """Tokens whose K/V must be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.state is RequestState.RUNNING and bool(self.output) and self.to_compute == 1

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def __repr__(self) -> str:
        return (
            f"Request(rid={self.rid}, {self.state.value}, prompt={len(self.prompt)}, "
            f"out={len(self.output)}, computed={self.num_computed}, borrowed={self.borrowed_pages})"
        )
