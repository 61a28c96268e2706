"""The connector's worker side over vLLM 0.32's own KV views (create_kv_cache_views, what
allocate_kv_cache calls) on CPU tensors, through a real gcache-server: in each of the six
KVCacheLayouts, with kernel-block splitting, with two KV cache groups aliasing one allocation
(the hybrid manager's pools), with an MLA spec and with state (Mamba) layers' raw padded views, pages saved from some blocks and loaded
into others come back byte-exact, blocks not loaded stay as they were, and the value tag
names what differs (the page's byte order, the kernel block size)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

import gcache
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import PageKeys
from gcache.integrations.vllm.kv.meta import GCacheConnectorMetadata, LoadSpec, PageRef, SaveSpec
from gcache.integrations.vllm.kv.settings import ConnectorSettings
from gcache.integrations.vllm.kv.state_groups import StateSpec
from gcache.integrations.vllm.kv.stats import ConnectorStats
from gcache.integrations.vllm.kv.worker_side import LayoutError, WorkerSide

BLOCKS, HEADS, HEAD, BLOCK_SIZE, LAYERS = 8, 2, 8, 32, 2
WAIT_S = 60.0


def group_views(raw, spec, layout, names, kernel=None):
    layer_stride, block_stride = compute_layout_strides(spec, BLOCKS, len(names), layout)[:2]
    tensor = KVCacheTensor(size=raw.numel(), layers=list(names), layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel)
    return dict(zip(names, views))


class Worker:
    def __init__(self, server, groups, kv_caches, **settings):
        self.stats = ConnectorStats()
        self.client = gcache.Client(server.address, transport="shm", verify_checksums=True)
        store = GuardedStore(self.client, 5.0, self.stats, logging.getLogger("test"), remove_corrupt=True)
        s = ConnectorSettings(url=server.address, staging_mib=8, **settings)
        self.side = WorkerSide(s, groups, PageKeys("m", None, 0, 1, False), self.client, store, self.stats, BLOCKS)
        self.side.register(kv_caches)

    def save(self, refs):
        self.side.save_step(GCacheConnectorMetadata(saves=[SaveSpec("r-save", tuple(refs))]))
        assert self.side.flush(WAIT_S)

    def load(self, refs) -> set:
        self.side.start_load(GCacheConnectorMetadata(loads=[LoadSpec("r-load", tuple(refs), True)]))
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            _, recving, failed = self.side.transfer_results(set())
            if recving:
                assert not failed
                return self.side.take_load_errors()
            time.sleep(0.01)
        raise AssertionError("the load never finished")

    def close(self):
        self.side.close()
        self.client.close()


def randomize(raw):
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(3)))


def bits(view, block):
    return view[block].contiguous().view(torch.int8).clone()


def round_trip(server, groups, views_of, raw, moves: dict, **settings):
    """moves: group index -> [(from block, to block)]; asserts byte-exact loads, untouched rest."""
    worker = Worker(server, groups, {n: v for g in groups for n, v in views_of[g.index].items()}, **settings)
    try:
        randomize(raw)
        saved = {
            (g, src): [bits(v, slice(src * r, (src + 1) * r)) for v in views_of[g].values()]
            for g, pairs in moves.items()
            for src, _ in pairs
            for r in [next(iter(views_of[g].values())).shape[0] // BLOCKS]
        }
        worker.save([PageRef(g, f"{g:04x}{src:012x}", src) for g, pairs in moves.items() for src, _ in pairs])
        raw.fill_(0)
        failed = worker.load(
            [PageRef(g, f"{g:04x}{src:012x}", dst) for g, pairs in moves.items() for src, dst in pairs]
        )
        assert failed == set()
        loaded_blocks = {dst for pairs in moves.values() for _, dst in pairs}
        for g, pairs in moves.items():
            r = next(iter(views_of[g].values())).shape[0] // BLOCKS
            for src, dst in pairs:
                for before, view in zip(saved[(g, src)], views_of[g].values()):
                    assert torch.equal(bits(view, slice(dst * r, (dst + 1) * r)), before), f"group {g} {src}->{dst}"
        for g in views_of:  # every block nobody loaded is still zero
            r = next(iter(views_of[g].values())).shape[0] // BLOCKS
            for b in set(range(BLOCKS)) - loaded_blocks:
                for view in views_of[g].values():
                    assert not bits(view, slice(b * r, (b + 1) * r)).any()
        return worker.side.tags
    finally:
        worker.close()


def spec_full():
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)


CASES = [(layout, None) for layout in KVCacheLayout] + [(KVCacheLayout.LBHNC, 16), (KVCacheLayout.LBNHC, 16)]


@pytest.mark.parametrize("layout,kernel", CASES, ids=[f"{lay.name}-k{k}" for lay, k in CASES])
def test_a_group_round_trips_byte_exact_in_every_layout(server, layout, kernel):
    spec = spec_full()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    raw = torch.zeros(spec.page_size_bytes * BLOCKS * LAYERS, dtype=torch.int8)
    views = group_views(raw, spec, layout, names, kernel)
    group = Group(0, "full", tuple(names), tuple(range(LAYERS)), BLOCK_SIZE, 0)
    tags = round_trip(server, [group], {0: views}, raw, {0: [(1, 6), (3, 0), (7, 2)]})
    order = "NHC" if layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC) else "HNC"
    assert tags[0].tag.startswith(f"{order}k{kernel or BLOCK_SIZE}h{HEADS}c{2 * HEAD * 2}float16n{LAYERS}-")


def test_two_groups_aliasing_one_allocation_round_trip(server):
    """The hybrid manager's pools: a sliding-window and a full group over the same bytes, block
    ids shared between them (each block belongs to one group at a time)."""
    spec = spec_full()
    swa_names = [f"model.layers.{i}.self_attn.attn" for i in (0, 2)]
    full_names = [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]
    raw = torch.zeros(spec.page_size_bytes * BLOCKS * 2, dtype=torch.int8)
    views = {
        0: group_views(raw, spec, KVCacheLayout.LBHNC, swa_names),
        1: group_views(raw, spec, KVCacheLayout.LBHNC, full_names),
    }
    assert views[0][swa_names[0]].data_ptr() == views[1][full_names[0]].data_ptr()  # aliased
    groups = [
        Group(0, "swa", tuple(swa_names), (0, 2), BLOCK_SIZE, 1),
        Group(1, "full", tuple(full_names), (1, 3), BLOCK_SIZE, 0),
    ]
    tags = round_trip(server, groups, views, raw, {0: [(1, 5)], 1: [(2, 4), (3, 6)]})
    assert tags[0].tag != tags[1].tag  # other layer ids: other values


def test_an_mla_group_round_trips(server):
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=72, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    raw = torch.zeros(spec.page_size_bytes * BLOCKS * LAYERS, dtype=torch.int8)
    views = group_views(raw, spec, KVCacheLayout.LBHNC, names)
    assert next(iter(views.values())).shape[1] == 1
    group = Group(0, "full", tuple(names), tuple(range(LAYERS)), BLOCK_SIZE, 0)
    round_trip(server, [group], {0: views}, raw, {0: [(0, 7), (5, 1)]})


def test_values_over_the_value_limit_round_trip_in_segments(server):
    spec = spec_full()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    raw = torch.zeros(spec.page_size_bytes * BLOCKS * LAYERS, dtype=torch.int8)
    views = group_views(raw, spec, KVCacheLayout.BLNHC, names)
    group = Group(0, "full", tuple(names), tuple(range(LAYERS)), BLOCK_SIZE, 0)
    tags = round_trip(server, [group], {0: views}, raw, {0: [(2, 3), (4, 5)]}, value_bytes_max=1500)
    assert LAYERS * spec.page_size_bytes == 4096 and tags[0].segments == 3  # 1500 + 1500 + 1096


def test_state_values_round_trip_unpadded_and_leave_the_padding_alone(server):
    """A state layer as vLLM hands it to a connector: raw int8 [blocks, 1, 1, state bytes] over a
    page padded up to the attention page. A value holds the unpadded bytes of every layer."""
    content, padded = 600, 1024
    raw = torch.zeros(LAYERS * BLOCKS * padded, dtype=torch.int8)
    names = [f"model.layers.{i}.mixer" for i in range(LAYERS)]
    views = {
        n: raw[i * BLOCKS * padded :].as_strided((BLOCKS, 1, 1, content), (padded, content, content, 1))
        for i, n in enumerate(names)
    }
    state = StateSpec("mamba2", ((3, 40), (2, 8, 8)), ("float32", "float32"), "default", "align", 0)
    group = Group(0, "state", tuple(names), tuple(range(LAYERS)), BLOCK_SIZE, 0, state=state)
    tags = round_trip(server, [group], {0: views}, raw, {0: [(1, 6), (3, 0)]})
    assert tags[0].tag.startswith(f"mamba2-b{LAYERS * content}n{LAYERS}-")
    pads = raw.view(LAYERS * BLOCKS, padded)[:, content:]
    assert not pads.any()  # the padding was neither stored nor written


def config_with(spec):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec_full()),
            KVCacheGroupSpec(["model.layers.1.mixer"], spec),
        ],
    )


def test_a_mamba_group_is_a_state_group_keyed_by_its_layout():
    from vllm.v1.kv_cache_interface import MambaSpec

    from gcache.integrations.vllm.kv.groups import groups_of

    mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((3, 8), (4, 8, 2)), dtypes=(torch.float16, torch.float32))
    full, state = groups_of(config_with(mamba))
    assert (full.kind, state.kind) == ("full", "state")
    assert state.state is not None
    assert state.state.shapes == ((3, 8), (4, 8, 2)) and state.state.dtypes == ("float16", "float32")
    assert state.state.state_kind == "mamba2" and state.layer_ids == (1,)


def test_a_kind_still_unsupported_stops_the_start_naming_it():
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    from gcache.integrations.vllm.kv.groups import GroupError, groups_of

    cross = CrossAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    with pytest.raises(GroupError, match=r"group 1 is CrossAttentionSpec, which GCacheConnector does not serve"):
        groups_of(config_with(cross))


def test_kv_on_a_device_the_connector_cannot_move_stops_the_start(server):
    spec = spec_full()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    raw = torch.zeros(spec.page_size_bytes * BLOCKS * LAYERS, dtype=torch.int8, device="meta")
    views = group_views(raw, spec, KVCacheLayout.LBHNC, names)
    group = Group(0, "full", tuple(names), tuple(range(LAYERS)), BLOCK_SIZE, 0)
    with pytest.raises(LayoutError, match="moves KV on CPU and CUDA devices, got meta"):
        Worker(server, [group], views)
