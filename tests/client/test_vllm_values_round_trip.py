"""The vLLM connector's unit of storage through a real gcache-server: a group's layers (one
head-outer layer, one KV-sharing duplicate of it, one token-outer layer) gathered per block into
staging slots registered with the client, put in segments (a value over the segment limit),
the KV zeroed, read back into other slots and scattered into other blocks: byte-exact, and
blocks that were not loaded stay zero. numpy views stand in for vLLM's tensors (the same
page_runs arithmetic; tests/integrations/vllm checks it on vLLM's own views)."""

from __future__ import annotations

import numpy as np
import pytest

import gcache
from gcache.integrations.vllm.kv.keys import segment_keys
from gcache.integrations.vllm.transfer.movers.host import HostMover
from gcache.integrations.vllm.transfer.page_runs import page_runs
from gcache.integrations.vllm.transfer.staging import StagingPool
from gcache.integrations.vllm.transfer.values import GroupValues
from tests.unit.test_vllm_page_runs_unit import View

BLOCKS, H, N, C = 12, 2, 16, 32


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_group_values_round_trip_byte_exact_in_segments(server, transport):
    rng = np.random.default_rng(7)
    head_outer = rng.integers(0, 255, (H, BLOCKS, N, C), dtype=np.uint8)  # LHBNC
    token_outer = rng.integers(0, 255, (BLOCKS, N, H, C), dtype=np.uint8)  # LBNHC
    layers = [View(head_outer.transpose(1, 0, 2, 3)), View(head_outer.transpose(1, 0, 2, 3)), None]
    layers[2] = View(token_outer.transpose(0, 2, 1, 3))
    values = GroupValues([page_runs(v, BLOCKS) for v in layers], segment_bytes_max=700)
    assert len(values.layers) == 2  # the KV-sharing layer is stored once
    assert values.value_bytes == 2 * H * N * C and values.segments == 3
    mover = HostMover()
    pool = StagingPool(mover.alloc_host(8 * values.value_bytes), values.value_bytes)
    before_a, before_b = head_outer.copy(), token_outer.copy()
    saved, loaded_into = [3, 0, 7, 11], [5, 1, 2, 9]
    with gcache.Client(server.address, transport=transport) as client:
        client.register_buffer(pool.base, pool.nbytes)
        slots = pool.take(len(saved))
        gather = values.gather(saved, pool.addresses(slots))
        assert len(gather.sizes) == len(saved) * values.runs_per_page  # H runs + 1 run per block
        mover.copy(None, gather.dst, gather.src, gather.sizes)
        keys, addresses, sizes = [], [], []
        for block, address in zip(saved, pool.addresses(slots)):
            seg_keys = segment_keys(f"page{block}.full-test_m_0_1".encode(), values.segments)
            for key, (at, length) in zip(seg_keys, values.segment_spans()):
                keys.append(key)
                addresses.append(int(address) + at)
                sizes.append(length)
        assert client.batch_put_from(keys, addresses, sizes) == [True] * len(keys)
        pool.give_back(slots)
        head_outer[:] = 0
        token_outer[:] = 0
        slots = pool.take(len(saved))
        targets = [int(a) + at for a in pool.addresses(slots) for at, _ in values.segment_spans()]
        assert client.batch_get_into(keys, targets, sizes) == sizes
        scatter = values.scatter(pool.addresses(slots), loaded_into)
        mover.copy(None, scatter.dst, scatter.src, scatter.sizes)
        pool.give_back(slots)
    for src, dst in zip(saved, loaded_into):
        assert np.array_equal(head_outer[:, dst], before_a[:, src])
        assert np.array_equal(token_outer[dst], before_b[src])
    untouched = [b for b in range(BLOCKS) if b not in loaded_into]
    assert not head_outer[:, untouched].any() and not token_outer[untouched].any()
    assert pool.free_slots() == pool.slot_count


def test_staging_pool_is_all_or_nothing_and_refuses_double_returns():
    pool = StagingPool(HostMover().alloc_host(4096), 1024)
    first = pool.take(3)
    assert pool.take(2) is None and pool.free_slots() == 1  # never a partial batch
    pool.give_back(first)
    with pytest.raises(ValueError, match="twice"):
        pool.give_back(first[:1])
    assert pool.addresses([0, 3]).tolist() == [pool.base, pool.base + 3 * 1024]
