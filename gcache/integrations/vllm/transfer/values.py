"""The unit of storage: one value per (page, KV cache group, TP rank) holding all of that group's
layers for one vLLM block, and the copies that gather it into a staging slot and scatter it back.

A value is the group's layers in the group's order, each layer's page as its runs lie in memory
(page_runs). Layers that share a view (vLLM's KV-sharing layers get their target's view) are
stored once. A value larger than `segment_bytes_max` (the node's value limit) is stored as
segments `@s0`, `@s1`, ... of the staged bytes (keys.value_keys).

`gather` / `scatter` build the (dst, src, size) lists of a batch of pages with numpy, no Python
loop per page or per run: what a BlockMover runs as one batched copy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from gcache.integrations.vllm.transfer.page_runs import PageRuns


class Copies(NamedTuple):
    dst: np.ndarray  # int64 addresses
    src: np.ndarray
    sizes: np.ndarray


class GroupValues:
    """How one group's pages become values: per unique layer view, its runs."""

    def __init__(self, layer_runs: list[PageRuns], segment_bytes_max: int):
        if segment_bytes_max < 1:
            raise ValueError("segment_bytes_max must be >= 1")
        unique, seen = [], set()
        self.kept: list[int] = []  # indices into layer_runs of the layers stored
        for i, runs in enumerate(layer_runs):
            ident = (runs.base, runs.block_stride, runs.offsets.tobytes(), runs.lengths.tobytes())
            if ident not in seen:  # a KV-sharing layer: the same bytes as a layer already in
                seen.add(ident)
                unique.append(runs)
                self.kept.append(i)
        if not unique:
            raise ValueError("a KV cache group without layers")
        self.layers = unique
        self.value_bytes = sum(r.page_bytes for r in unique)
        self.segment_bytes_max = segment_bytes_max
        self.segments = -(-self.value_bytes // segment_bytes_max)
        # Where each run of a page lands in its value: offsets in layer order, runs in address order.
        self._value_offsets = np.cumsum([0] + [int(n) for r in unique for n in r.lengths])[:-1].astype(np.int64)
        self._lengths = np.concatenate([r.lengths for r in unique]).astype(np.int64)
        self.runs_per_page = len(self._lengths)

    def segment_spans(self) -> list[tuple[int, int]]:
        """(offset, length) of each segment within a value."""
        step = self.segment_bytes_max
        return [(at, min(step, self.value_bytes - at)) for at in range(0, self.value_bytes, step)]

    def _device_addresses(self, block_ids: np.ndarray) -> np.ndarray:
        parts = [r.addresses(block_ids)[0] for r in self.layers]  # each [pages, runs of that layer]
        return np.concatenate(parts, axis=1)

    def gather(self, block_ids: ArrayLike, slot_addresses: ArrayLike) -> Copies:
        """Copies of each block's pages into its slot (block_ids[i] -> slot_addresses[i])."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        slots = np.asarray(slot_addresses, dtype=np.int64)
        if blocks.shape != slots.shape:
            raise ValueError("one slot per block")
        src = self._device_addresses(blocks)
        dst = slots[:, None] + self._value_offsets[None, :]
        sizes = np.broadcast_to(self._lengths, src.shape)
        return Copies(dst.ravel(), src.ravel(), sizes.ravel())

    def scatter(self, slot_addresses: ArrayLike, block_ids: ArrayLike) -> Copies:
        """Copies of each slot's value back into its block's pages."""
        gathered = self.gather(block_ids, slot_addresses)
        return Copies(gathered.src, gathered.dst, gathered.sizes)
