"""page_runs over vLLM 0.32's own KV views: `create_kv_cache_views` (what `allocate_kv_cache`
calls) on a CPU buffer in each of the six KVCacheLayout values, with and without kernel-block
splitting, and two layers sharing a backing allocation. For every block, the runs cover exactly
the bytes of that block's kernel pages (computed here from element indices and strides, not from
page_runs' arithmetic), and a gather through them followed by a scatter into a zeroed buffer
gives back the same view contents."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from gcache.integrations.vllm.transfer.movers.host import HostMover
from gcache.integrations.vllm.transfer.page_runs import page_runs

BLOCKS, HEADS, HEAD, BLOCK_SIZE, LAYERS = 6, 2, 8, 32, 2


def views(layout: KVCacheLayout, kernel_block_size: int | None):
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    page = spec.page_size_bytes
    # vLLM's own packed strides for this layout (what get_kv_cache_config places)
    layer_stride, block_stride = compute_layout_strides(spec, BLOCKS, LAYERS, layout)[:2]
    size = page * BLOCKS * LAYERS
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size, layers=[f"l{i}" for i in range(LAYERS)], layer_stride=layer_stride, block_stride=block_stride
    )
    return raw, create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel_block_size)


def covered_bytes(view, blocks: slice) -> set[int]:
    """Every byte address of view[blocks], from element indices and strides."""
    part = view[blocks]
    idx = np.indices(part.shape).reshape(len(part.shape), -1)
    offsets = (np.array(part.stride())[:, None] * idx).sum(0) * part.element_size()
    start = part.data_ptr()
    return {int(start + o + k) for o in offsets for k in range(part.element_size())}


CASES = [(layout, None) for layout in KVCacheLayout] + [
    (KVCacheLayout.LBHNC, 16),
    (KVCacheLayout.LBNHC, 16),
]  # vLLM itself refuses to split the head-outer layouts' blocks (their pages are not dense)


@pytest.mark.parametrize("layout,kernel", CASES, ids=[f"{lay.name}-k{k}" for lay, k in CASES])
def test_page_runs_cover_each_block_exactly_and_round_trip(layout, kernel):
    if kernel is not None and not layout.is_layer_compact:
        pytest.skip("vLLM never splits block-outer layouts into kernel blocks")
    raw, layer_views = views(layout, kernel)
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(1)))
    before = [v.clone() for v in layer_views]
    for view in layer_views:
        runs = page_runs(view, BLOCKS)
        r = view.shape[0] // BLOCKS
        assert runs.kernel_block_size == (kernel or BLOCK_SIZE)
        assert runs.page_bytes == r * view[0].numel() * view.element_size()
        expected_order = "NHC" if layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC) else "HNC"
        assert runs.order == expected_order
        expected_runs = HEADS * r if layout in (KVCacheLayout.LHBNC, KVCacheLayout.BHLNC) else 1
        assert len(runs.lengths) <= expected_runs
        for b in range(BLOCKS):
            starts, lengths = runs.addresses(np.array([b]))
            got = {int(s) + k for s, n in zip(starts[0], lengths[0]) for k in range(int(n))}
            assert got == covered_bytes(view, slice(b * r, (b + 1) * r)), f"block {b}"
    # Gather every block of every layer through the runs, zero the buffer, scatter back.
    mover = HostMover()
    dst_list, src_list, size_list = [], [], []
    staging = mover.alloc_host(raw.numel())
    base = np.frombuffer(staging, dtype=np.uint8).ctypes.data
    at = 0
    for view in layer_views:
        starts, lengths = page_runs(view, BLOCKS).addresses(np.arange(BLOCKS))
        for s, n in zip(starts.ravel(), lengths.ravel()):
            src_list.append(int(s))
            dst_list.append(base + at)
            size_list.append(int(n))
            at += int(n)
    assert at == raw.numel()  # every byte of the buffer belongs to exactly one page
    mover.copy(None, np.array(dst_list), np.array(src_list), np.array(size_list))
    raw.zero_()
    mover.copy(None, np.array(src_list), np.array(dst_list), np.array(size_list))
    for view, old in zip(layer_views, before):
        assert torch.equal(view.view(torch.int16), old.view(torch.int16))  # bits: random bytes hold NaNs
