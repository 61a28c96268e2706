"""What the engine needs of a model: one batched forward over paged KV (BatchModel: the
contract the real model, transformer.Model, the simulated one, sim.SimulatedModel, and the
benches' wrappers implement), and what speculative decoding needs of one with MTP blocks
(MTPModel: transformer.Model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from gcache.worker.config import ModelConfig
    from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV


class BatchModel(ABC):
    """A decoder the engine steps. Called from the engine thread only, once per step."""

    @abstractmethod
    def forward_batch(
        self,
        chunks: Sequence[tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray | None, RequestKV]],
        kv: DualKVCache,
        all_logits: bool = False,
        layer_ready: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """Run every chunk, one per request, as one batch.

        chunks: [(tokens, positions or None, request KV)]: each request's next tokens (a
        prefill chunk or one decode token), their positions (None: from req_kv.num_tokens on),
        and the request's page table in `kv`, whose pages already cover the chunk (grown by
        the caller) and whose SWA pages of the window are live. A request appears once.
        Writes each chunk's K/V into its pages and advances req_kv.num_tokens by the chunk.
        layer_ready(layer), when given, is called for every layer in order, before that
        layer's KV pages are read or written (KV loaded from the host tier arrives layer by
        layer while earlier layers compute).
        Returns one logits array per chunk, in order: [T, vocab] if all_logits, else [1, vocab]
        for the last position. Raises ValueError for chunks that break the rules above (or
        all_logits where the model does not support it)."""


class MTPModel(BatchModel):
    """A BatchModel with MTP blocks: what speculative decoding (engine/speculative.py) and the
    MTP blocks (model/mtp.MTPHead, built over any MTPModel) use of it. Arrays are the model's
    backend's (xp: numpy or cupy). `layer` below is an index of the main stack or an MTP
    block's weight-name prefix ("mtp.{d}."); every method computes, none keeps state."""

    config: ModelConfig
    xp: Any

    @abstractmethod
    def forward_hidden(
        self,
        chunks: Sequence[tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray | None, RequestKV]],
        kv: DualKVCache,
        layer_ready: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """forward_batch, returning each chunk's last hidden states [T, hidden] (before the
        final norm) instead of logits (logits(h) gives them)."""

    @abstractmethod
    def prefix_hidden(
        self, tokens: Any, req_kv: RequestKV, kv: DualKVCache, lo: int, hi: int, swa_pages: list | None = None
    ) -> tuple[Any, int]:
        """(hidden, lo2): the last hidden states of positions [lo2, hi) of a cached prefix
        (lo2 >= lo: where its live SWA KV starts), read from its pages through the forward's
        path, writing nothing; (None, hi) where no position qualifies."""

    @abstractmethod
    def reference_hidden(self, tokens: Any) -> Any:
        """The dense, cache-free last hidden states of every position (tests' ground truth)."""

    @abstractmethod
    def logits(self, hidden: Any) -> Any:
        """Logits of hidden states (the main model's final norm and output head)."""

    # ---- the layer API the MTP blocks are built from ---------------------------------------
    @abstractmethod
    def weight(self, name: str) -> Any:
        """A weight by its name in the weights file ("lm_head.weight", "mtp.0.proj", ...)."""

    @abstractmethod
    def embed(self, ids: Any) -> Any:
        """Token embeddings [T, hidden]."""

    @abstractmethod
    def norm(self, x: Any, name: str) -> Any:
        """RMSNorm of x with the weight `name`."""

    @abstractmethod
    def qkv(self, layer: int | str, x: Any, positions: np.ndarray) -> tuple[Any, Any, Any]:
        """The layer's attention norm, then q [T, heads, D], k and v [T, kv_heads, D], RoPE applied."""

    @abstractmethod
    def attend(self, q: Any, k: Any, v: Any, qpos: np.ndarray, kpos: np.ndarray, window: int | None) -> Any:
        """Attention [T, heads * D] of q over keys at kpos <= qpos (and > qpos - window)."""

    @abstractmethod
    def finish_layer(self, layer: int | str, x: Any, attn: Any) -> Any:
        """The rest of the layer: output projection, MLP, both residuals."""
