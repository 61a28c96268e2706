"""Where one vLLM block of one layer lies in memory: the byte runs of a KV view's page.

vLLM 0.32 hands the connector one `[blocks, heads, tokens, content]` view per layer over one
backing buffer, strided by the resolved `KVCacheLayout` (six permutations of layer, block,
head, token and content). A page is `view[b]`; it is one dense run of bytes when the layout is
block-compact (LBHNC, LBNHC, BLHNC, BLNHC: dense but not `is_contiguous()` for the NHC ones)
and `heads` runs otherwise (LHBNC, BHLNC). With kernel-block splitting a vLLM block is `r`
consecutive kernel blocks (view dim 0 is `blocks * r`).

The connector stores a page's bytes in ascending address order, exactly as they lie: no
reordering, so a copy is one DMA per run. The order they lie in (which of heads and tokens is
outer) and the kernel block size are part of the key's layout tag (keys.layout_tag), so values
are only ever read back into the same byte order.

Pure arithmetic over shapes and strides: works on torch tensors of any device, and on
anything with `.shape`, `.stride()`, `.element_size()` and `.data_ptr()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # torch's type: Any to the type check (not installed in .venv)
    import torch

RUNS_PER_PAGE_MAX = 4096  # a page in more pieces than this is a layout we refuse to move piecewise


class PageRunsError(ValueError):
    """A KV view whose pages the connector cannot address (the message says what it found)."""


class PageRuns(NamedTuple):
    """Block b's bytes: runs at `base + b * block_stride + offsets[i]`, `lengths[i]` bytes each,
    in address order. `order` is the page's dimension order outer to inner ("HNC" or "NHC")."""

    base: int
    block_stride: int
    num_blocks: int
    offsets: np.ndarray  # int64, bytes from the block's first byte
    lengths: np.ndarray  # int64
    order: str
    kernel_block_size: int  # tokens of one kernel block (the block size when not split)

    @property
    def page_bytes(self) -> int:
        return int(self.lengths.sum())

    def addresses(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) of every run of these blocks, block by block: shape [blocks, runs]."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise PageRunsError(f"block ids {blocks.tolist()} reach outside the KV view ({self.num_blocks} blocks)")
        starts = self.base + blocks[:, None] * self.block_stride + self.offsets[None, :]
        return starts, np.broadcast_to(self.lengths, starts.shape)


def _dense_span(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int | None:
    """Bytes of a non-overlapping dense tensor, or None when it has holes or overlaps."""
    dims = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    expected = 1
    for stride, extent in dims:
        if stride != expected:
            return None
        expected *= extent
    return expected * itemsize


def _runs(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, at: int, out: list[tuple[int, int]]) -> None:
    if any(s < 0 for s in strides):
        raise PageRunsError(f"negative strides {strides} in a KV page")
    span = _dense_span(shape, strides, itemsize)
    if span is not None:
        out.append((at, span))
        return
    # Not dense: split along the outermost dimension (largest stride) and try again.
    d = max((i for i, n in enumerate(shape) if n != 1), key=lambda i: strides[i])
    rest_shape, rest_strides = shape[:d] + shape[d + 1 :], strides[:d] + strides[d + 1 :]
    for i in range(shape[d]):
        _runs(rest_shape, rest_strides, itemsize, at + i * strides[d] * itemsize, out)
        if len(out) > RUNS_PER_PAGE_MAX:
            raise PageRunsError(f"a KV page splits into more than {RUNS_PER_PAGE_MAX} runs (shape {shape})")


def _merged(runs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    runs.sort()
    merged: list[list[int]] = []
    for start, length in runs:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += length
        elif merged and merged[-1][0] + merged[-1][1] > start:
            raise PageRunsError("a KV page overlaps itself")
        else:
            merged.append([start, length])
    table = np.array(merged, dtype=np.int64).reshape(-1, 2)
    return table[:, 0].copy(), table[:, 1].copy()


def page_order(strides: tuple[int, ...]) -> str:
    """Which of heads (H) and tokens (N) is outer in a page of a [B, H, N, C] view."""
    _, s_heads, s_tokens, _ = strides
    return "HNC" if s_heads >= s_tokens else "NHC"


def page_runs(view: torch.Tensor, num_blocks: int) -> PageRuns:
    """The runs of a `[blocks * r, heads, tokens, content]` view whose vLLM blocks are `num_blocks`."""
    shape = tuple(int(n) for n in view.shape)
    strides = tuple(int(s) for s in view.stride())
    if len(shape) != 4:
        raise PageRunsError(f"a KV view of shape {shape}: expected [blocks, heads, tokens, content]")
    if num_blocks < 1 or shape[0] % num_blocks:
        raise PageRunsError(f"a KV view of {shape[0]} kernel blocks does not split into {num_blocks} vLLM blocks")
    r = shape[0] // num_blocks  # kernel blocks per vLLM block
    itemsize = int(view.element_size())
    pieces: list[tuple[int, int]] = []
    for j in range(r):  # the r kernel blocks of vLLM block 0, wherever each lies
        _runs(shape[1:], strides[1:], itemsize, j * strides[0] * itemsize, pieces)
    offsets, lengths = _merged(pieces)
    return PageRuns(
        base=int(view.data_ptr()),
        block_stride=r * strides[0] * itemsize,
        num_blocks=num_blocks,
        offsets=offsets,
        lengths=lengths,
        order=page_order(strides),
        kernel_block_size=shape[2],
    )
