"""Hybrid (sliding-window) models: SGLang's per-pool batch_exists_v2 / batch_get_v2 / batch_set_v2.

The full-attention KV pool is the anchor (v1 keys); the SWA pool is a second MHA host
pool (fewer layers, its own slots) whose pages are stored under "swa" keys. SWA pages
exist only at checkpoints: a prefix of N pages is restorable when pages [0, N) of the
full pool and the last `window` SWA pages before N are all in the store.
"""

from __future__ import annotations

import gcache

from .sglang_support import chain, page_bytes, slots

WINDOW = 2  # SWA pages a restore needs before its cut


def hybrid(sgl, attach, storage_config, host_pool, address, seed=None):
    hicache_storage, _ = sgl
    full = host_pool(pages=16, layer_num=2, seed=seed)
    swa = host_pool(pages=8, layer_num=1, seed=None if seed is None else seed + 1, label="swa")
    names = hicache_storage.PoolName
    backend = attach(storage_config(address), full, {names.KV: full, names.SWA: swa})
    return backend, full, swa


def swa_transfer(sgl, keys, host_indices=None, window=WINDOW):
    hicache_storage, _ = sgl
    return hicache_storage.PoolTransfer(
        name=hicache_storage.PoolName.SWA,
        keys=keys,
        host_indices=host_indices,
        hit_policy=hicache_storage.PoolHitPolicy.TRAILING_PAGES,
    )


def test_swa_prefix_needs_full_pages_and_its_swa_window(sgl, server, storage_config, attach, host_pool):
    hicache_storage, _ = sgl
    kv, swa_name = hicache_storage.PoolName.KV, hicache_storage.PoolName.SWA
    backend, full, swa = hybrid(sgl, attach, storage_config, host_pool, server.address, seed=30)
    hashes = chain(8, salt=30)
    assert backend.batch_set_v1(hashes, slots(full, list(range(8)))) == [True] * 8
    # SWA checkpoints after page 4 (window pages 2, 3) and after page 8 (pages 6, 7).
    for pages, swa_slots in ((hashes[2:4], [0, 1]), (hashes[6:8], [2, 3])):
        assert backend.batch_set_v2([swa_transfer(sgl, pages, slots(swa, swa_slots))]) == {swa_name: [True, True]}

    probe = [swa_transfer(sgl, ["window"] * WINDOW)]  # SGLang passes the window as len(keys)
    result = backend.batch_exists_v2(hashes, probe)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (8, [4, 8])
    assert result.extra_pool_hit_pages == {kv: 8, swa_name: 8}

    raw = gcache.Client(server.address)
    # A missing full page at 6 cuts the prefix there: only the checkpoint at 4 is left.
    assert raw.remove(f"{hashes[6]}.full-pf-bfloat16-k_org-model_0_1".encode()) is True
    result = backend.batch_exists_v2(hashes, probe)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4])
    assert result.extra_pool_hit_pages == {kv: 6, swa_name: 4}

    # Full pages 0-5 are there, but the checkpoint at 4 lost SWA page 3: nothing is restorable.
    assert raw.remove(f"{hashes[3]}.swa-pf-bfloat16-k_org-model_0_1".encode()) is True
    result = backend.batch_exists_v2(hashes, probe)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    assert result.extra_pool_hit_pages == {kv: 6}
    raw.close()


def test_swa_pages_round_trip_byte_for_byte(sgl, server, storage_config, attach, host_pool):
    hicache_storage, _ = sgl
    swa_name = hicache_storage.PoolName.SWA
    backend, full, swa = hybrid(sgl, attach, storage_config, host_pool, server.address, seed=31)
    hashes = chain(4, salt=31)
    assert backend.batch_set_v2([swa_transfer(sgl, hashes[2:4], slots(swa, [5, 6]))]) == {swa_name: [True, True]}
    raw = gcache.Client(server.address)
    for page_hash, page in zip(hashes[2:4], (5, 6)):
        k, v = raw.get_batch([f"{page_hash}.swa-pf-bfloat16-{part}_org-model_0_1".encode() for part in "kv"])
        assert k + v == page_bytes(swa, page)
    assert raw.batch_is_exist([f"{h}.full-pf-bfloat16-k_org-model_0_1".encode() for h in hashes]) == [False] * 4
    raw.close()

    reader, _, swa2 = hybrid(sgl, attach, storage_config, host_pool, server.address)
    got = reader.batch_get_v2([swa_transfer(sgl, hashes[1:4], slots(swa2, [0, 1, 2]))])
    assert got == {swa_name: [False, True, True]}  # page 1 was never stored
    assert [page_bytes(swa2, p) for p in (1, 2)] == [page_bytes(swa, p) for p in (5, 6)]
    assert not any(page_bytes(swa2, 0))


def test_a_bad_transfer_fails_alone(sgl, server, storage_config, attach, host_pool):
    hicache_storage, _ = sgl
    kv, swa_name = hicache_storage.PoolName.KV, hicache_storage.PoolName.SWA
    backend, full, swa = hybrid(sgl, attach, storage_config, host_pool, server.address, seed=32)
    hashes = chain(2, salt=32)
    bad = swa_transfer(sgl, hashes, slots(swa, [0]))  # indices for 1 page, 2 keys
    good = hicache_storage.PoolTransfer(name=kv, keys=hashes, host_indices=slots(full, [0, 1]))
    assert backend.batch_set_v2([bad, good]) == {swa_name: [False, False], kv: [True, True]}
    unknown = hicache_storage.PoolTransfer(
        name=hicache_storage.PoolName.MAMBA, keys=hashes, host_indices=slots(full, [0, 1])
    )
    assert backend.batch_get_v2([unknown]) == {hicache_storage.PoolName.MAMBA: [False, False]}
    assert backend.batch_exists_v2(hashes, [unknown]).kv_hit_pages == 0
