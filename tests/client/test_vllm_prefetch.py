"""The connector's prefetch (kv/prefetch.py) through a real gcache-server: a request's prefix
read into staging slots when it arrives. What must hold: the staged prefix is the leading
pages read whole, with the stored bytes; slots of pages it could not read go back at once; a
prefetch cancelled while it reads gives every slot back when the read returns; take() hands a
range to a load and gives the rest back; no room (staging, prefetches in flight) refuses a
prefetch and changes nothing; no slot is ever lost."""

from __future__ import annotations

import logging

import pytest

import gcache
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.vllm.kv.prefetch import Prefetcher
from gcache.integrations.vllm.kv.stats import ConnectorStats
from gcache.integrations.vllm.transfer.movers.host import HostMover
from gcache.integrations.vllm.transfer.staging import StagingPool
from tests.support.gated_store import GatedStore

VALUE = 4096
SEGMENTS = 2  # each value in two segments, as a value over the node's limit is stored
SPANS = {0: [(0, VALUE // 2), (VALUE // 2, VALUE // 2)]}
WAIT_S = 60.0  # generous bounds: outcomes, never timing, are asserted


def page_keys(name: str, page: int) -> list[list[bytes]]:
    return [[f"{name}-{page}@s{s}".encode() for s in range(SEGMENTS)]]  # one group


class Rig:
    def __init__(self, server, slots: int = 8, requests_max: int = 4):
        self.client = gcache.Client(server.address, transport="tcp", verify_checksums=True)
        self.stats = ConnectorStats()
        self.store = GatedStore(GuardedStore(self.client, 5.0, self.stats, logging.getLogger("test")), "get_into")
        self.pool = StagingPool(HostMover().alloc_host(slots * VALUE), VALUE)
        self.client.register_buffer(self.pool.base, self.pool.nbytes)
        self.p = Prefetcher(self.pool, self.store, self.stats, SPANS, requests_max)

    def put(self, name: str, page: int) -> bytes:
        value = bytes([page + 1]) * (VALUE // 2) + bytes([page + 101]) * (VALUE // 2)
        for s, key in enumerate(page_keys(name, page)[0]):
            assert self.client.put(key, value[s * VALUE // 2 : (s + 1) * VALUE // 2])
        return value

    def start(self, req: str, name: str, first: int, pages: int) -> bool:
        return self.p.start(req, first, [0], [page_keys(name, p) for p in range(first, first + pages)])

    def ready(self, req: str):
        entry = self.p.get(req)
        assert entry is not None and entry.done.wait(WAIT_S)
        return entry

    def slot_bytes(self, slot: int) -> bytes:
        at = self.pool.address(slot) - self.pool.base
        return bytes(self.pool.memory[at : at + VALUE])

    def close(self):
        self.store.gate.set()
        self.p.close(WAIT_S)
        self.client.close()


@pytest.fixture
def rig(server):
    rig = Rig(server)
    yield rig
    rig.close()


def test_the_staged_prefix_holds_the_stored_bytes_and_stops_at_the_first_missing_page(rig):
    values = [rig.put("a", p) for p in (0, 1, 3)]  # page 2 is missing
    assert rig.start("r1", "a", 0, 5)
    entry = rig.ready("r1")
    assert entry.staged_end == 2
    assert rig.pool.free_slots() == rig.pool.slot_count - 2  # pages 2..4 went back at once
    handed = rig.p.take("r1", 0, 2)
    assert sorted(handed) == [(0, 0), (1, 0)]
    assert [rig.slot_bytes(handed[(p, 0)]) for p in (0, 1)] == values[:2]
    assert rig.p.get("r1") is None
    rig.p.give_back(list(handed.values()))  # the worker, once its copy completed
    assert rig.pool.free_slots() == rig.pool.slot_count
    assert rig.stats.snapshot()["prefetch_pages_staged"] == 2


def test_take_hands_only_the_loaded_range_and_gives_the_rest_back(rig):
    for p in range(4):
        rig.put("b", p)
    assert rig.start("r1", "b", 0, 4)
    rig.ready("r1")
    handed = rig.p.take("r1", 1, 3)  # vLLM held page 0 itself; page 3 is past the hit
    assert sorted(handed) == [(1, 0), (2, 0)]
    assert rig.pool.free_slots() == rig.pool.slot_count - 2
    rig.p.give_back(list(handed.values()))
    assert rig.pool.free_slots() == rig.pool.slot_count


def test_a_prefetch_cancelled_while_the_store_is_slow_gives_its_slots_back_when_the_read_returns(rig):
    for p in range(3):
        rig.put("c", p)
    rig.store.gate.clear()
    assert rig.start("r1", "c", 0, 3)
    assert rig.store.started.wait(WAIT_S)
    assert not rig.p.get("r1").done.is_set()
    assert rig.pool.free_slots() == rig.pool.slot_count - 3
    entry = rig.p.get("r1")
    rig.p.cancel("r1")  # the request was aborted
    assert rig.p.get("r1") is None and rig.p.take("r1", 0, 3) == {}
    rig.store.gate.set()
    assert entry.done.wait(WAIT_S)
    assert rig.pool.free_slots() == rig.pool.slot_count
    assert rig.stats.snapshot()["prefetch_cancelled"] == 1


def test_take_before_the_read_returns_hands_nothing_and_loses_nothing(rig):
    rig.put("d", 0)
    rig.store.gate.clear()
    assert rig.start("r1", "d", 0, 1)
    assert rig.store.started.wait(WAIT_S)
    entry = rig.p.get("r1")
    assert rig.p.take("r1", 0, 1) == {}
    rig.store.gate.set()
    assert entry.done.wait(WAIT_S)
    assert rig.pool.free_slots() == rig.pool.slot_count


def test_no_room_refuses_a_prefetch_and_changes_nothing(server):
    rig = Rig(server, slots=4, requests_max=2)
    try:
        for p in range(5):
            rig.put("e", p)
        assert not rig.start("big", "e", 0, 5)  # more pages than staging slots
        assert rig.pool.free_slots() == 4 and rig.p.get("big") is None
        rig.store.gate.clear()
        assert rig.start("r1", "e", 0, 1) and rig.start("r2", "e", 1, 1)
        assert not rig.start("r3", "e", 2, 1)  # prefetches in flight at their limit
        assert not rig.start("r1", "e", 0, 1)  # one per request
        assert rig.pool.free_slots() == 2
        rig.store.gate.set()
        for req in ("r1", "r2"):
            rig.ready(req)
            rig.p.cancel(req)
        assert rig.pool.free_slots() == 4
        assert rig.stats.snapshot()["prefetch_refused"] == 2
    finally:
        rig.close()


def test_a_store_that_is_down_stages_nothing(server):
    rig = Rig(server)
    try:
        rig.put("f", 0)
        server.kill()
        assert rig.start("r1", "f", 0, 1)
        assert rig.ready("r1").staged_end == 0
        assert rig.pool.free_slots() == rig.pool.slot_count
    finally:
        rig.close()
