"""Hybrid Mamba models (Nemotron-H, Qwen3-Next, Falcon-H1, ...) through SGLang 0.5.23's
HiCache per-pool API: the Mamba host pool (PoolName.MAMBA, one state slot per page,
TRAILING_PAGES hit policy) beside the full-attention KV pool. SGLang exposes it, so the
GCache backend serves it: each state is stored under "mamba" keys (its temporal and conv
tensors), a prefix of N pages is restorable only when KV pages [0, N) and the state at
page N are in the store, and states round-trip byte for byte. The Mamba pool runs SGLang's
own page code (gcache.testing.sglang_mamba_pool).
"""

from __future__ import annotations

import gcache
from gcache.testing.sglang_mamba_pool import MambaHostPoolStandIn

from .sglang_support import chain, slots


def mamba_pool(seed: int | None = None) -> MambaHostPoolStandIn:
    import torch

    pool = MambaHostPoolStandIn(slots=8)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for buf in pool.get_hybrid_pool_buffer():
            raw = buf.view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return pool


def hybrid(sgl, attach, storage_config, host_pool, address, seed=None):
    hicache_storage, _ = sgl
    full = host_pool(pages=16, layer_num=2, seed=seed)
    mamba = mamba_pool(seed=None if seed is None else seed + 1)
    names = hicache_storage.PoolName
    backend = attach(storage_config(address), full, {names.KV: full, names.MAMBA: mamba})
    return backend, full, mamba


def mamba_transfer(sgl, keys, host_indices=None):
    hicache_storage, _ = sgl
    return hicache_storage.PoolTransfer(
        name=hicache_storage.PoolName.MAMBA,
        keys=keys,
        host_indices=host_indices,
        hit_policy=hicache_storage.PoolHitPolicy.TRAILING_PAGES,
    )


def state_bytes(pool: MambaHostPoolStandIn, slot: int) -> bytes:
    return pool.get_data_page(slot).numpy().tobytes()


def test_a_mamba_prefix_needs_its_kv_pages_and_the_state_at_its_end(sgl, server, storage_config, attach, host_pool):
    hicache_storage, _ = sgl
    kv, mamba_name = hicache_storage.PoolName.KV, hicache_storage.PoolName.MAMBA
    backend, full, mamba = hybrid(sgl, attach, storage_config, host_pool, server.address, seed=40)
    hashes = chain(8, salt=40)
    assert backend.batch_set_v1(hashes, slots(full, list(range(8)))) == [True] * 8
    # States after page 4 and after page 8 (keyed by the page they end).
    states = [hashes[3], hashes[7]]
    assert backend.batch_set_v2([mamba_transfer(sgl, states, mamba.slot_indices([2, 5]))]) == {mamba_name: [True] * 2}

    probe = [mamba_transfer(sgl, ["state"])]  # SGLang asks for the one state at the cut
    result = backend.batch_exists_v2(hashes, probe)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (8, [4, 8])

    raw = gcache.Client(server.address)
    # The state at 8 gone: only the cut at 4 is left, though every KV page is there.
    assert raw.remove(mamba_key(hashes[7], 0)) is True  # its temporal part: the state is gone
    result = backend.batch_exists_v2(hashes, probe)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4])
    assert result.extra_pool_hit_pages[kv] == 8
    # A KV page missing before the state: nothing is restorable past it.
    assert raw.remove(f"{hashes[1]}.full-pf-bfloat16-k_org-model_0_1".encode()) is True
    result = backend.batch_exists_v2(hashes, probe)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    raw.close()


def mamba_key(page_hash: str, entry: int) -> bytes:
    """A Mamba entry's key (entry 0: the temporal state, 1: the conv state)."""
    return f"{page_hash}.mamba-pf-bfloat16.float32-kv@g{entry}_org-model_0_1".encode()


def test_mamba_states_round_trip_byte_for_byte(sgl, server, storage_config, attach, host_pool):
    hicache_storage, _ = sgl
    mamba_name = hicache_storage.PoolName.MAMBA
    backend, _, mamba = hybrid(sgl, attach, storage_config, host_pool, server.address, seed=41)
    hashes = chain(4, salt=41)
    assert backend.batch_set_v2([mamba_transfer(sgl, hashes[2:4], mamba.slot_indices([6, 1]))]) == {
        mamba_name: [True, True]
    }
    reader, _, mamba2 = hybrid(sgl, attach, storage_config, host_pool, server.address)
    got = reader.batch_get_v2([mamba_transfer(sgl, hashes[1:4], mamba2.slot_indices([0, 3, 4]))])
    assert got == {mamba_name: [False, True, True]}  # the state at page 1 was never stored
    assert state_bytes(mamba2, 3) == state_bytes(mamba, 6) and state_bytes(mamba2, 4) == state_bytes(mamba, 1)
    assert not any(state_bytes(mamba2, 0))
    assert any(state_bytes(mamba, 6))


def test_a_state_of_another_layout_is_a_miss(sgl, server, storage_config, attach, host_pool):
    # Another state shape under the same model name (the keys carry model, TP and layout,
    # not the state's shape): the temporal entry does not fit, the state is a miss.
    hicache_storage, _ = sgl
    mamba_name = hicache_storage.PoolName.MAMBA
    backend, _, mamba = hybrid(sgl, attach, storage_config, host_pool, server.address, seed=42)
    hashes = chain(2, salt=42)
    assert backend.batch_set_v2([mamba_transfer(sgl, hashes, mamba.slot_indices([0, 1]))]) == {mamba_name: [True] * 2}
    full = host_pool(pages=16, layer_num=2)
    other = MambaHostPoolStandIn(slots=8, temporal_shape=(2, 8, 16))
    reader = attach(storage_config(server.address), full, {hicache_storage.PoolName.KV: full, mamba_name: other})
    assert reader.batch_get_v2([mamba_transfer(sgl, hashes, other.slot_indices([0, 1]))]) == {mamba_name: [False] * 2}
    assert other.temporal_buffer.count_nonzero() == 0  # no state bytes landed
