"""GCacheHiCacheStorage through SGLang 0.5.23's real StorageBackendFactory and a real gcache-server.

Host pools: SGLang's MHATokenToKVPoolHost cannot be built on this CPU-only machine, so
HostPoolStandIn runs SGLang's own page methods (see gcache/testing/sglang_modules.py).
Every round trip is checked byte for byte against SGLang's get_data_page, and the store
is read with a raw gcache.Client under the exact keys the README documents.
"""

from __future__ import annotations

import pytest
import torch

import gcache

from .sglang_support import chain, page_bytes, slots, zero_pages

LAYOUTS = ["page_first", "page_first_direct", "page_head", "layer_first"]
CODES = {"page_first": "pf", "page_first_direct": "pfd", "page_head": "ph", "layer_first": "lf"}
SUFFIX = "_org-model_0_1"  # model "org/model", tp rank 0 of 1


def entry_keys(page_hash: str, layout: str, layers: int) -> list[bytes]:
    """The documented keys of one MHA page, in get_page_buffer_meta's order."""
    code = CODES[layout]
    if layout == "layer_first":
        return [
            f"{page_hash}.full-{code}-bfloat16-{part}@g{layer}{SUFFIX}".encode()
            for layer in range(layers)
            for part in ("k", "v")
        ]
    return [f"{page_hash}.full-{code}-bfloat16-{part}{SUFFIX}".encode() for part in ("k", "v")]


def test_factory_loads_the_backend_by_module_path(sgl, server, storage_config, attach, host_pool):
    hicache_storage, _ = sgl
    from gcache.integrations.sglang.backend import GCacheHiCacheStorage

    pool = host_pool()
    backend = attach(storage_config(server.address), pool)
    assert type(backend) is GCacheHiCacheStorage
    assert isinstance(backend, hicache_storage.HiCacheStorage)
    assert backend.mem_pool_host is pool
    assert backend.builder.suffix == SUFFIX


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_byte_for_byte(layout, server, storage_config, attach, host_pool):
    src = host_pool(layout, seed=1)
    writer = attach(storage_config(server.address), src)
    hashes = chain(5)
    src_pages = [2, 7, 3, 9, 11]
    assert writer.batch_set_v1(hashes, slots(src, src_pages)) == [True] * 5

    # The store holds each page's entries under the documented keys, and their bytes
    # put together are SGLang's flat page (K of every layer, then V).
    raw = gcache.Client(server.address)
    for page_hash, page in zip(hashes, src_pages):
        keys = entry_keys(page_hash, layout, src.layer_num)
        values = raw.get_batch(keys)
        ks, vs = values[0::2], values[1::2]
        assert b"".join(ks + vs) == page_bytes(src, page)
    raw.close()

    # Another process (a restarted rank) reads them into other slots of its own pool.
    dst = host_pool(layout)
    reader = attach(storage_config(server.address), dst)
    dst_pages = [0, 1, 5, 6, 4]
    assert reader.batch_exists(hashes) == 5
    assert reader.batch_get_v1(hashes, slots(dst, dst_pages)) == [True] * 5
    for s, d in zip(src_pages, dst_pages):
        assert page_bytes(dst, d) == page_bytes(src, s)
    assert zero_pages(dst) == [p for p in range(dst.page_num) if p not in dst_pages]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v0_round_trip_byte_for_byte(layout, server, storage_config, attach, host_pool):
    src = host_pool(layout, seed=2)
    writer = attach(storage_config(server.address, interface_v1=False), src)
    hashes = chain(3, salt=2)
    src_pages = [4, 1, 8]
    pages = [src.get_data_page(p * src.page_size) for p in src_pages]
    assert writer.batch_set(hashes, pages) is True
    raw = gcache.Client(server.address)
    code = CODES[layout]
    assert raw.get_batch([f"{h}.full-{code}-bfloat16-page{SUFFIX}".encode() for h in hashes]) == [
        page_bytes(src, p) for p in src_pages
    ]
    raw.close()

    dst = host_pool(layout)
    reader = attach(storage_config(server.address, interface_v1=False), dst)
    assert reader.batch_exists(hashes) == 3
    assert all(reader.exists(h) for h in hashes)
    got = reader.batch_get(hashes, [dst.get_dummy_flat_data_page() for _ in hashes])
    for tensor, d in zip(got, [0, 3, 5]):
        dst.set_from_flat_data_page(d * dst.page_size, tensor)
    for s, d in zip(src_pages, [0, 3, 5]):
        assert page_bytes(dst, d) == page_bytes(src, s)
    single = reader.get(hashes[1], dst.get_dummy_flat_data_page())
    assert single.view(torch.uint8).numpy().tobytes() == page_bytes(src, 1)
    missing = chain(1, salt=99)[0]
    assert reader.get(missing, dst.get_dummy_flat_data_page()) is None
    assert reader.exists(missing) is False
    assert reader.set(missing, src.get_data_page(0)) is True and reader.exists(missing)


def test_batch_exists_counts_the_prefix_up_to_a_gap(server, storage_config, attach, host_pool):
    pool = host_pool(seed=3)
    backend = attach(storage_config(server.address), pool)
    hashes = chain(10, salt=3)
    # Pages 0-3 and 5-9 stored; page 4 not.
    assert backend.batch_set_v1(hashes[:4], slots(pool, [0, 1, 2, 3])) == [True] * 4
    assert backend.batch_set_v1(hashes[5:], slots(pool, [5, 6, 7, 8, 9])) == [True] * 5
    raw = gcache.Client(server.address)
    requests = lambda: raw.stats()["counters"]["requests"]  # noqa: E731
    idle = -(requests() - requests())  # what one STATS call adds
    before = requests()
    assert backend.batch_exists(hashes) == 4
    assert requests() - before - idle == 1  # one EXISTS round trip for 20 entry keys
    assert backend.batch_exists(hashes[5:]) == 5
    assert backend.batch_exists([]) == 0

    # A page counts only with all its entries: drop page 2's V.
    assert raw.remove(entry_keys(hashes[2], "page_first", pool.layer_num)[1]) is True
    assert backend.batch_exists(hashes) == 2
    assert backend.batch_get_v1(hashes[:4], slots(pool, [10, 11, 12, 13])) == [True, True, False, True]

    assert backend.batch_set_v1(hashes[2:5], slots(pool, [2, 3, 4])) == [True] * 3
    assert backend.batch_exists(hashes) == 10
    raw.close()


def test_tp_ranks_never_see_each_others_pages(server, storage_config, attach, host_pool):
    hashes = chain(4, salt=4)
    pools = [host_pool(seed=10 + rank) for rank in range(2)]
    ranks = [attach(storage_config(server.address, tp_rank=rank, tp_size=2), pools[rank]) for rank in range(2)]
    assert ranks[0].batch_set_v1(hashes, slots(pools[0], [0, 1, 2, 3])) == [True] * 4
    assert ranks[1].batch_exists(hashes) == 0
    probe = host_pool()
    peek = attach(storage_config(server.address, tp_rank=1, tp_size=2), probe)
    assert peek.batch_get_v1(hashes, slots(probe, [0, 1, 2, 3])) == [False] * 4
    assert zero_pages(probe) == list(range(probe.page_num))  # nothing was written into it

    assert ranks[1].batch_set_v1(hashes, slots(pools[1], [0, 1, 2, 3])) == [True] * 4
    for rank in range(2):
        fresh = host_pool()
        backend = attach(storage_config(server.address, tp_rank=rank, tp_size=2), fresh)
        assert backend.batch_get_v1(hashes, slots(fresh, [4, 5, 6, 7])) == [True] * 4
        assert [page_bytes(fresh, p) for p in (4, 5, 6, 7)] == [page_bytes(pools[rank], p) for p in (0, 1, 2, 3)]
    raw = gcache.Client(server.address)
    assert raw.batch_is_exist([f"{hashes[0]}.full-pf-bfloat16-k_org-model_{r}_2".encode() for r in (0, 1)]) == [
        True,
        True,
    ]
    raw.close()


def test_mla_ranks_share_the_writer_ranks_pages(server, storage_config, attach, host_pool):
    """MLA KV is replicated across TP ranks: keys carry no TP rank, so rank 1 reads rank 0's."""
    hashes = chain(2, salt=5)
    src = host_pool(seed=5)
    writer = attach(storage_config(server.address, tp_rank=0, tp_size=2, is_mla=True), src)
    assert writer.builder.suffix == "_org-model"
    assert writer.batch_set_v1(hashes, slots(src, [0, 1])) == [True, True]
    dst = host_pool()
    reader = attach(storage_config(server.address, tp_rank=1, tp_size=2, is_mla=True), dst)
    assert reader.batch_get_v1(hashes, slots(dst, [2, 3])) == [True, True]
    assert [page_bytes(dst, p) for p in (2, 3)] == [page_bytes(src, p) for p in (0, 1)]
    mha = attach(storage_config(server.address, tp_rank=0, tp_size=2), host_pool())
    assert mha.batch_exists(hashes) == 0


def test_writes_skip_pages_already_stored(server, storage_config, attach, host_pool):
    pool = host_pool(seed=6)
    backend = attach(storage_config(server.address), pool)
    hashes = chain(4, salt=6)
    assert backend.batch_set_v1(hashes[:2], slots(pool, [0, 1])) == [True, True]
    raw = gcache.Client(server.address)
    stored_before = raw.stats()["counters"]["puts_stored"]
    assert backend.batch_set_v1(hashes, slots(pool, [0, 1, 2, 3])) == [True] * 4
    assert raw.stats()["counters"]["puts_stored"] - stored_before == 4  # pages 2, 3: K and V
    assert backend.counters()["entries_skipped_existing"] == 4
    raw.close()


def test_get_stats_has_the_shape_sglang_logs(server, storage_config, attach, host_pool):
    pool = host_pool(seed=7)
    backend = attach(storage_config(server.address, metrics=True), pool)
    hashes = chain(3, salt=7)
    assert backend.batch_set_v1(hashes, slots(pool, [0, 1, 2])) == [True] * 3
    assert backend.batch_get_v1(hashes, slots(pool, [3, 4, 5])) == [True] * 3
    stats = backend.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().prefetch_pgs == []  # drained, as SGLang expects
    assert backend.counters()["pages_written"] == 3 and backend.counters()["pages_read"] == 3


def test_clear_removes_what_this_process_stored(server, storage_config, attach, host_pool):
    pool = host_pool(seed=8)
    backend = attach(storage_config(server.address), pool)
    other = attach(storage_config(server.address, tp_rank=1, tp_size=2), host_pool(seed=9))
    hashes = chain(3, salt=8)
    assert backend.batch_set_v1(hashes, slots(pool, [0, 1, 2])) == [True] * 3
    assert other.batch_set_v1(hashes, slots(other.mem_pool_host, [0, 1, 2])) == [True] * 3
    assert backend.clear() is True
    assert backend.batch_exists(hashes) == 0
    assert other.batch_exists(hashes) == 3  # another rank's pages stay


def test_bad_calls_answer_failure_and_change_nothing(server, storage_config, attach, host_pool):
    pool = host_pool(seed=10)
    backend = attach(storage_config(server.address), pool)
    hashes = chain(2, salt=10)
    # Host indices for 3 pages but 2 keys; not whole pages: refused, nothing stored.
    assert backend.batch_set_v1(hashes, slots(pool, [0, 1, 2])) == [False, False]
    assert backend.batch_set_v1(hashes, slots(pool, [0, 1])[:-1]) == [False, False]
    assert backend.batch_get_v1(hashes, torch.arange(3)) == [False, False]
    assert backend.batch_exists(hashes) == 0
    assert backend.batch_set_v1([], torch.arange(0)) == []
