"""page_runs and copy_ranges without vLLM or torch: numpy arrays strided as vLLM's layouts are
(a [B, H, N, C] view over one buffer), a gather through the runs and a scatter back."""

from __future__ import annotations

import numpy as np
import pytest

from gcache._native import copy_ranges
from gcache.integrations.vllm.transfer.numpy_view import NumpyView as View
from gcache.integrations.vllm.transfer.page_runs import PageRunsError, page_runs

B, H, N, C = 5, 3, 4, 8


def test_contiguous_hnc_page_is_one_run_per_block():
    buf = np.arange(B * H * N * C, dtype=np.uint16).reshape(B, H, N, C)
    runs = page_runs(View(buf), B)
    assert runs.order == "HNC" and len(runs.lengths) == 1
    assert runs.page_bytes == H * N * C * 2 and runs.block_stride == H * N * C * 2


def test_nhc_page_is_dense_but_not_contiguous_and_still_one_run():
    buf = np.zeros((B, N, H, C), dtype=np.uint16).transpose(0, 2, 1, 3)  # LBNHC's view
    runs = page_runs(View(buf), B)
    assert runs.order == "NHC" and len(runs.lengths) == 1 and runs.page_bytes == H * N * C * 2


def test_head_outer_layout_gives_one_run_per_head_and_a_round_trip_is_exact():
    buf = np.random.default_rng(0).integers(0, 1 << 16, (H, B, N, C), dtype=np.uint16)
    view = buf.transpose(1, 0, 2, 3)  # LHBNC: heads outside blocks
    runs = page_runs(View(view), B)
    assert len(runs.lengths) == H
    before = view.copy()
    blocks = np.array([4, 0, 2])
    starts, lengths = runs.addresses(blocks)
    staging = np.zeros(int(lengths.sum()), dtype=np.uint8)
    dst = staging.ctypes.data + np.concatenate([[0], np.cumsum(lengths.ravel())[:-1]])
    copy_ranges(dst.astype(np.uint64), starts.ravel().astype(np.uint64), lengths.ravel().astype(np.uint64))
    buf[:] = 0
    copy_ranges(starts.ravel().astype(np.uint64), dst.astype(np.uint64), lengths.ravel().astype(np.uint64))
    assert np.array_equal(view[blocks], before[blocks])
    assert not view[[1, 3]].any()  # blocks not moved stay untouched


def test_kernel_block_split_merges_consecutive_kernel_pages():
    buf = np.zeros((B * 2, H, N, C), dtype=np.uint16)  # 2 kernel blocks per vLLM block
    runs = page_runs(View(buf), B)
    assert len(runs.lengths) == 1 and runs.kernel_block_size == N and runs.page_bytes == 2 * H * N * C * 2


def test_bad_geometry_and_blocks_outside_are_refused():
    with pytest.raises(PageRunsError, match="does not split"):
        page_runs(View(np.zeros((7, H, N, C), dtype=np.uint8)), 2)
    runs = page_runs(View(np.zeros((B, H, N, C), dtype=np.uint8)), B)
    with pytest.raises(PageRunsError, match="outside"):
        runs.addresses(np.array([B]))


def test_copy_ranges_refuses_mismatched_lengths_and_null_addresses():
    with pytest.raises(ValueError, match="one length"):
        copy_ranges(np.zeros(2, np.uint64), np.zeros(1, np.uint64), np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="null"):
        copy_ranges(np.zeros(1, np.uint64), np.ones(1, np.uint64), np.ones(1, np.uint64))
