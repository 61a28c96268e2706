"""What the engine needs of a model: one batched forward over paged KV (the contract the real
model, transformer.Model, the simulated one, sim.SimulatedModel, and the benches' wrappers
implement)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

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
