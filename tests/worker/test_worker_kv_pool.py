"""Paged KV pools: allocator invariants, budget sizing, a request's page tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.common.attention import AttentionKind
from gcache.worker.config import ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache, PagePool, RequestKV

CFG = ModelConfig()


def test_alloc_free_basics():
    pool = PagePool(4, "p")
    a = pool.alloc(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    assert all(pool.is_allocated(p) for p in a) and not pool.is_allocated(3)
    assert pool.alloc(2) is None and pool.num_free == 1  # too few: nothing changes
    assert pool.alloc(0) == []
    pool.free([a[1]])
    with pytest.raises(ValueError, match="double free of page"):
        pool.free([a[1]])
    with pytest.raises(ValueError, match="unknown page 4"):
        pool.free([4])
    with pytest.raises(ValueError, match="unknown page -1"):
        pool.free([-1])
    with pytest.raises(ValueError, match="twice"):
        pool.free([a[0], a[0]])
    with pytest.raises(ValueError, match="alloc count"):
        pool.alloc(-1)
    # A failed free is atomic: a[0] is still allocated after the batch with a bad page failed.
    with pytest.raises(ValueError):
        pool.free([a[0], a[1]])
    assert pool.is_allocated(a[0]) and pool.num_free == 2
    pool.check_integrity()


def test_check_integrity_detects_corruption():
    pool = PagePool(4, "p")
    pool.alloc(2)
    pool._free.append(pool._free[0])  # a page on the free list twice
    with pytest.raises(AssertionError, match="twice"):
        pool.check_integrity()
    pool = PagePool(4, "p")
    pool._allocated[0] = True  # allocated and free at once
    with pytest.raises(AssertionError, match="disagree"):
        pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60),
    seed=st.integers(0, 2**32 - 1),
)
def test_randomized_alloc_free_keeps_invariants(size, ops, seed):
    rng = np.random.default_rng(seed)
    pool, held = PagePool(size, "p"), set()
    for is_alloc, n in ops:
        if is_alloc:
            got = pool.alloc(n)
            if n > size - len(held):
                assert got is None
            else:
                assert len(got) == n and not held & set(got) and all(0 <= p < size for p in got)
                held |= set(got)
        elif held:
            pick = list(rng.choice(sorted(held), size=min(n, len(held)), replace=False))
            pool.free(pick)
            held -= set(pick)
            if pick:
                with pytest.raises(ValueError):
                    pool.free(pick[:1])
        assert pool.num_free == size - len(held)
        assert all(pool.is_allocated(p) == (p in held) for p in range(size))
        pool.check_integrity()


def test_dual_cache_shapes_and_page_bytes():
    kv = DualKVCache(CFG, 10, 4)
    assert kv.k_full.shape == (2, 10, 16, 2, 32) and kv.v_swa.shape == (12, 4, 16, 2, 32)
    assert kv.bytes_per_page(AttentionKind.FULL) == 2 * 2 * 16 * 2 * 32 * 4
    assert kv.bytes_per_page(AttentionKind.SWA) == 6 * kv.bytes_per_page(AttentionKind.FULL)
    arrays = kv.k_full.nbytes + kv.v_full.nbytes + kv.k_swa.nbytes + kv.v_swa.nbytes
    assert kv.total_bytes() == arrays
    assert (
        kv.layer_slot[6] == (AttentionKind.FULL, 0)
        and kv.layer_slot[13] == (AttentionKind.FULL, 1)
        and kv.layer_slot[7] == (AttentionKind.SWA, 6)
    )
    full = DualKVCache(CFG.all_full(), 3, 3)
    assert full.bytes_per_page(AttentionKind.SWA) == 0 and full.k_swa.size == 0
    with pytest.raises(ValueError, match="kind"):
        kv.bytes_per_page("other")


@settings(max_examples=80, deadline=None)
@given(
    budget=st.integers(0, 50_000_000),
    ratio=st.floats(0.01, 4.0),
    pattern=st.sampled_from(["hybrid", "all_full", "all_swa"]),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_from_budget_respects_the_budget(budget, ratio, pattern, dtype):
    cfg = {"hybrid": CFG, "all_full": CFG.all_full(), "all_swa": CFG.all_swa()}[pattern].with_dtype(dtype)
    full, swa = DualKVCache.pages_for_budget(cfg, budget, ratio)
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    assert full * bf + swa * bs <= budget
    if bf and bs:
        assert swa == int(full * ratio)
        # Tight: one more full page with its (fractional) share of SWA would not fit,
        # so at most about one page of each kind is left unused.
        assert (full + 1) * (bf + ratio * bs) > budget * (1 - 1e-12)
        assert budget - (full * bf + swa * bs) < bf + (ratio + 1) * bs
    elif bf:  # no SWA layers: SWA pages cost nothing, one per full page
        assert swa == full and (full + 1) * bf > budget


def test_from_budget_allocates_the_arrays():
    budget = 8 * 1024 * 1024
    kv = DualKVCache.from_budget(CFG, budget, 0.25)
    assert 0 < kv.total_bytes() <= budget
    assert kv.swa.num_pages == int(kv.full.num_pages * 0.25)
    with pytest.raises(ValueError, match="swa_full_ratio"):
        DualKVCache.from_budget(CFG, budget, 0.0)
    with pytest.raises(ValueError, match="budget"):
        DualKVCache.from_budget(CFG, -1, 0.5)


def test_request_grow_is_all_or_nothing():
    kv = DualKVCache(CFG, 10, 3)
    req = RequestKV(16, 128)
    assert req.grow(kv, 48) and req.num_pages == 3
    assert not req.grow(kv, 49)  # the SWA pool is empty: the full page taken first goes back
    assert kv.full.num_free == 7 and kv.swa.num_free == 0 and req.num_pages == 3
    assert req.grow(kv, 40)  # already covered
    req.release(kv)
    assert kv.full.num_free == 10 and kv.swa.num_free == 3 and req.num_pages == 0
    kv.check_integrity()


def test_shrink_drops_the_kv_past_its_end_and_never_the_trees_pages():
    """RequestKV.shrink (rejected speculative drafts): the tables end at the page covering the
    new length, the request's own pages past it go back; the tree's leading pages stay."""
    kv = DualKVCache(CFG, 20, 20)
    owner = RequestKV(16, 128)
    assert owner.grow(kv, 32)
    owner.num_tokens = 32
    req = RequestKV.from_prefix(16, 128, 32, owner.full_pages, owner.swa_pages)
    assert req.grow(kv, 90) and req.num_pages == 6
    req.num_tokens = 90
    req.shrink(kv, 70)  # pages_for(70) = 5: the sixth goes back
    assert req.num_tokens == 70 and req.num_pages == 5 and kv.full.num_used == 5 and kv.swa.num_used == 5
    req.shrink(kv, 65)  # same page count: KV length only
    assert req.num_tokens == 65 and req.num_pages == 5
    req.shrink(kv, 10)  # inside the tree's pages: they are never freed
    assert req.num_tokens == 10 and req.num_pages == 2 and req.full_pages == owner.full_pages
    assert kv.full.num_used == 2 and kv.swa.num_used == 2
    with pytest.raises(ValueError, match="shrink to 11 tokens"):
        req.shrink(kv, 11)  # never grows
    with pytest.raises(ValueError):
        req.shrink(kv, -1)
    assert req.num_tokens == 10
    req.release(kv)
    owner.release(kv)
    assert kv.full.num_used == 0 and kv.swa.num_used == 0
    kv.check_integrity()


@pytest.mark.parametrize(
    "length,expected_window",
    [
        (0, range(0, 0)),
        (100, range(0, 7)),
        (128, range(0, 8)),
        (129, range(0, 9)),
        (144, range(1, 9)),
        (145, range(1, 10)),
        (1000, range(54, 63)),
    ],
)
def test_swa_window_pages(length, expected_window):
    """The window pages cover tokens [length - W, length): the contract's swa_tail_pages."""
    req = RequestKV(16, 128)
    assert req.swa_window_pages(length) == expected_window
    if length:
        first = expected_window.start
        assert first * 16 <= max(0, length - 128) < (first + 1) * 16 or first == 0


def test_out_of_window_swa_is_freed_but_not_the_trees():
    kv = DualKVCache(CFG, 100, 100)
    owner = RequestKV(16, 128)
    assert owner.grow(kv, 64)
    owner.num_tokens = 64
    req = RequestKV.from_prefix(16, 128, 64, owner.full_pages, owner.swa_pages)
    assert req.owned_from == 4 and req.num_tokens == 64
    assert req.grow(kv, 400)
    req.num_tokens = 400
    out = req.swa_out_of_window()
    assert out == list(range(4, (400 - 128) // 16))  # pages 0..3 belong to the tree
    swa_before = kv.swa.num_free
    assert req.free_swa_out_of_window(kv) == len(out)
    assert kv.swa.num_free == swa_before + len(out)
    assert all(req.swa_pages[i] is None for i in out) and all(req.swa_pages[i] is not None for i in range(4))
    assert req.free_swa_out_of_window(kv) == 0
    assert req.held_pages() == (25, 4 + 25 - 17)
    req.release(kv)  # frees its own pages only; the owner's stay allocated
    assert kv.full.num_used == 4 and kv.swa.num_used == 4
    owner.release(kv)
    assert kv.full.num_used == 0 and kv.swa.num_used == 0
    kv.check_integrity()


def test_from_prefix_requires_window_swa():
    swa = [None] * 8 + [1] * 8
    RequestKV.from_prefix(16, 128, 256, list(range(16)), swa)
    with pytest.raises(ValueError, match="lacks SWA KV"):
        RequestKV.from_prefix(16, 128, 256, list(range(16)), [None] * 9 + [1] * 7)
    with pytest.raises(ValueError, match="page-aligned"):
        RequestKV.from_prefix(16, 128, 250, list(range(16)), swa)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 70)), max_size=40))
def test_randomized_requests_hold_only_their_window(steps):
    """Several requests grow, drop out-of-window SWA and finish on small pools: pages are never
    shared or leaked, and each request holds exactly its window's SWA pages."""
    kv = DualKVCache(CFG, 60, 30)
    reqs = [RequestKV(16, 128) for _ in range(3)]
    for which, n in steps:
        req = reqs[which]
        if n > 60:  # finish the request
            req.release(kv)
        elif req.grow(kv, req.num_tokens + n):
            req.num_tokens += n
            req.free_swa_out_of_window(kv)
            live = [i for i, p in enumerate(req.swa_pages) if p is not None]
            assert live == list(req.swa_window_pages(req.num_tokens))
        kv.check_integrity()
        full = [p for r in reqs for p in r.full_pages]
        swa = [p for r in reqs for p in r.swa_pages if p is not None]
        assert len(set(full)) == len(full) and len(set(swa)) == len(swa)
        assert kv.full.num_used == len(full) and kv.swa.num_used == len(swa)
        assert all(kv.full.is_allocated(p) for p in full) and all(kv.swa.is_allocated(p) for p in swa)
    for r in reqs:
        r.release(kv)
    assert kv.full.num_used == 0 and kv.swa.num_used == 0
