"""The vLLM connector's save and load state machines (transfers.Transfers) through a real
gcache-server, on StandInDevice: a device made of host memory whose queued work runs only when
an event forces it, so a missing stream wait shows up as wrong bytes. numpy arrays stand in for
vLLM's KV views (page_runs reads the same shapes and strides).

What must hold: a save copies the bytes the step's forward wrote (queued on the compute stream
before the save); blocks vLLM reuses next step are rewritten only after the save's copy; a
request's blocks are released at the copy's event, before its put; a load lands after vLLM's
queued work on its blocks; a missing or short value is reported failed and its block is left
as it was; a full staging pool or put queue drops saves (counted) and never blocks the step."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import gcache
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.vllm.kv.keys import segment_keys
from gcache.integrations.vllm.kv.settings import ConnectorSettings
from gcache.integrations.vllm.kv.stats import ConnectorStats
from gcache.integrations.vllm.transfer.movers.stand_in import StandInDevice
from gcache.integrations.vllm.transfer.page_runs import page_runs
from gcache.integrations.vllm.transfer.staging import StagingPool
from gcache.integrations.vllm.transfer.transfers import Page, Staged, Transfers
from gcache.integrations.vllm.transfer.values import GroupValues
from tests.support.gated_store import GatedStore
from tests.unit.test_vllm_page_runs_unit import View

LAYERS, BLOCKS, H, N, C = 3, 16, 2, 8, 16
WAIT_S = 60.0  # generous bounds: outcomes, never timing, are asserted


class Rig:
    """One worker's transfers over a [layers, blocks, heads, tokens, content] KV buffer."""

    def __init__(self, server, slots: int = 8, value_bytes_max: int = 1 << 20, jobs_max: int = 16):
        self.kv = np.zeros((LAYERS, BLOCKS, H, N, C), dtype=np.uint8)
        self.device = StandInDevice()
        self.values = GroupValues([page_runs(View(self.kv[i]), BLOCKS) for i in range(LAYERS)], value_bytes_max)
        self.stats = ConnectorStats()
        self.client = gcache.Client(server.address, transport="tcp", verify_checksums=True)
        self.store = GatedStore(GuardedStore(self.client, 5.0, self.stats, logging.getLogger("test")), "put_from")
        pools = [
            StagingPool(self.device.alloc_host(slots * self.values.value_bytes), self.values.value_bytes)
            for _ in (0, 1)
        ]
        for pool in pools:
            self.client.register_buffer(pool.base, pool.nbytes)
        settings = ConnectorSettings(url=server.address, save_queue_jobs_max=jobs_max)
        self.t = Transfers(self.device, {0: self.values}, set(), pools[0], pools[1], self.store, self.stats, settings)

    def page(self, block: int, name: str) -> Page:
        return Page(0, segment_keys(f"{name}.full-test_m_0_1".encode(), self.values.segments), block)

    def write(self, block: int, value: int) -> None:
        """A "kernel" on the compute stream: the forward writes a block (runs when forced)."""
        self.device.launch(self.device.compute, lambda: self.kv[:, block].fill(value))

    def wait_saved(self) -> None:
        assert self.t.flush(WAIT_S)

    def stored(self, name: str) -> bytes | None:
        keys = self.page(0, name).keys
        parts = [self.client.get(k) for k in keys]
        return None if any(p is None for p in parts) else b"".join(parts)

    def close(self):
        self.store.gate.set()
        self.t.close(WAIT_S)
        self.client.close()


@pytest.fixture
def rig(server):
    rig = Rig(server)
    yield rig
    rig.close()


def value_of(fill: int, values: GroupValues) -> bytes:
    return bytes([fill]) * values.value_bytes


def test_the_stand_in_reads_stale_bytes_without_a_wait(rig):
    """The control: a copy not ordered after the compute stream misses the queued write."""
    rig.write(3, 9)
    slot = rig.t.save_pool.take(1)
    copies = rig.values.gather([3], rig.t.save_pool.addresses(slot))
    stream = rig.device.new_stream("save")
    rig.device.copy(stream, copies.dst, copies.src, copies.sizes)
    rig.device.synchronize(rig.device.record(stream))
    address = int(rig.t.save_pool.addresses(slot)[0])
    assert bytes(rig.t.save_pool.memory[address - rig.t.save_pool.base :][:8]) == b"\0" * 8
    rig.device.run_all(rig.device.compute)
    assert rig.kv[:, 3].min() == 9


def test_a_save_copies_what_the_queued_forward_wrote(rig):
    rig.write(3, 7)
    rig.write(5, 8)
    rig.t.save([rig.page(3, "a"), rig.page(5, "b")], ["r1", "r1"], reused_next_step=False)
    rig.wait_saved()
    assert rig.stored("a") == value_of(7, rig.values) and rig.stored("b") == value_of(8, rig.values)
    assert rig.stats.snapshot()["values_saved"] == 2


def test_blocks_reused_next_step_are_rewritten_only_after_the_copy(rig):
    rig.store.gate.clear()  # the put waits: only the copy can protect the bytes
    rig.write(4, 5)
    rig.t.save([rig.page(4, "swa")], ["r1"], reused_next_step=True)
    rig.write(4, 0)  # next step: vLLM hands block 4 to another request, which writes it
    rig.device.run_all(rig.device.compute)
    assert rig.kv[:, 4].max() == 0
    rig.store.gate.set()
    rig.wait_saved()
    assert rig.stored("swa") == value_of(5, rig.values)


def test_a_finished_request_is_released_at_its_copy_not_after_its_put(rig):
    rig.store.gate.clear()
    rig.write(2, 3)
    rig.t.save([rig.page(2, "f")], ["done"], reused_next_step=False)
    assert rig.store.started.wait(WAIT_S)  # the saver synchronized the copy, then began the put
    assert rig.t.copies_pending({"done"}) == set()  # released though the put has not finished
    assert rig.stored("f") is None
    rig.store.gate.set()
    rig.wait_saved()
    assert rig.stored("f") == value_of(3, rig.values)


def test_a_request_whose_copy_has_not_run_is_not_released(server):
    rig = Rig(server, jobs_max=4)
    try:
        rig.store.gate.clear()
        # A put job ahead holds the saver thread, so the second save's copy stays queued.
        rig.t.save([rig.page(1, "first")], ["r0"], reused_next_step=False)
        assert rig.store.started.wait(WAIT_S)
        rig.write(6, 4)
        rig.t.save([rig.page(6, "second")], ["r1"], reused_next_step=False)
        assert rig.t.copies_pending({"r1"}) == {"r1"}
        rig.store.gate.set()
        rig.wait_saved()
        assert rig.t.copies_pending({"r1"}) == set()
        assert rig.stored("second") == value_of(4, rig.values)
    finally:
        rig.close()


def test_preempted_blocks_are_rewritten_only_after_the_saves_copy(rig):
    rig.store.gate.clear()
    rig.write(8, 6)
    rig.t.save([rig.page(8, "p")], ["r1"], reused_next_step=False)
    rig.t.blocks_freed()  # handle_preemptions: the request's blocks go back to vLLM
    rig.write(8, 1)
    rig.device.run_all(rig.device.compute)
    rig.store.gate.set()
    rig.wait_saved()
    assert rig.stored("p") == value_of(6, rig.values)


def _stored_pages(rig, fills: dict) -> list[Page]:
    pages = []
    for block, fill in fills.items():
        rig.write(block, fill)
        pages.append(rig.page(block, f"v{block}"))
    rig.t.save(pages, ["r"] * len(pages), reused_next_step=False)
    rig.wait_saved()
    return pages


def _loaded(rig, deadline_s: float = WAIT_S) -> list:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done = rig.t.take_loaded()
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("the load never finished")


def test_an_async_load_lands_after_vllms_queued_work_on_its_blocks(rig):
    _stored_pages(rig, {1: 11, 2: 12})
    rig.device.run_all(rig.device.compute)
    rig.write(9, 0)  # vLLM zeroes the newly allocated blocks, queued before the load
    rig.write(10, 0)
    rig.t.load_later("req", [Page(0, rig.page(1, "v1").keys, 9), Page(0, rig.page(2, "v2").keys, 10)])
    assert _loaded(rig) == [("req", set())]
    rig.device.run_all(rig.device.compute)
    assert rig.kv[:, 9].min() == rig.kv[:, 9].max() == 11 and rig.kv[:, 10].min() == 12


def test_a_sync_load_lands_before_the_forward_reads(rig):
    _stored_pages(rig, {1: 21})
    rig.device.run_all(rig.device.compute)
    rig.write(11, 0)
    failed = rig.t.load_now([Page(0, rig.page(1, "v1").keys, 11)])
    assert failed == set()
    seen = []
    rig.device.launch(rig.device.compute, lambda: seen.append(int(rig.kv[:, 11].min())))  # the forward
    rig.device.run_all(rig.device.compute)
    assert seen == [21]


def _staged(rig, fills: list[int]):
    """Values a prefetch read already: slots of the rig's save pool filled as pages, and a
    release that records when it ran (the slots must outlive the copy from them)."""
    slots = rig.t.save_pool.take(len(fills))
    addresses = rig.t.save_pool.addresses(slots)
    for fill, address in zip(fills, addresses):
        at = int(address) - rig.t.save_pool.base
        rig.t.save_pool.memory[at : at + rig.values.value_bytes] = bytes([fill]) * rig.values.value_bytes
    released = []
    return Staged(addresses, lambda: released.append(slots)), released


def test_a_staged_sync_load_lands_before_the_forward_and_releases_after_its_copy(rig):
    staged, released = _staged(rig, [41, 42])
    rig.write(5, 0)  # vLLM's queued work on the blocks, before the load
    rig.write(6, 0)
    rig.t.load_staged_now([Page(0, [], 5), Page(0, [], 6)], staged)
    assert released == []  # the copy is queued, not run: the slots are still read from
    seen = []
    rig.device.launch(rig.device.compute, lambda: seen.append((int(rig.kv[:, 5].min()), int(rig.kv[:, 6].max()))))
    rig.device.run_all(rig.device.compute)
    assert seen == [(41, 42)]
    rig.t.take_loaded()  # the next step reaps landed copies
    assert len(released) == 1
    assert rig.stats.snapshot()["staged_values_loaded"] == 2


def test_a_staged_async_load_reports_done_after_its_copy_and_releases(rig):
    staged, released = _staged(rig, [51])
    rig.write(7, 0)
    rig.t.load_later("req", [Page(0, [], 7)], staged)
    rig.t.wait_loaded(WAIT_S)
    assert _loaded(rig) == [("req", set())]
    assert len(released) == 1
    rig.device.run_all(rig.device.compute)
    assert rig.kv[:, 7].min() == rig.kv[:, 7].max() == 51


def test_a_sync_load_larger_than_half_the_pool_goes_in_chunks(server):
    rig = Rig(server, slots=4)  # 2 slots per chunk
    try:
        fills = {b: 60 + b for b in range(1, 5)}
        pages = _stored_pages(rig, fills)
        rig.device.run_all(rig.device.compute)
        targets = [Page(0, p.keys, 10 + i) for i, p in enumerate(pages)]
        assert rig.t.load_now(targets) == set()
        rig.device.run_all(rig.device.compute)
        assert [int(rig.kv[:, 10 + i].min()) for i in range(4)] == [61, 62, 63, 64]
        rig.t.take_loaded()
        assert rig.t.load_pool.free_slots() == rig.t.load_pool.slot_count
    finally:
        rig.close()


def test_missing_and_short_values_fail_their_blocks_and_leave_them_untouched(rig):
    pages = _stored_pages(rig, {1: 31, 2: 32})
    rig.client.put(rig.page(0, "short").keys[0], b"x" * 100)  # a torn value: shorter than a page
    rig.device.run_all(rig.device.compute)
    rig.kv[:, 12:15] = 99
    targets = [
        Page(0, pages[0].keys, 12),
        Page(0, rig.page(0, "missing").keys, 13),
        Page(0, rig.page(0, "short").keys, 14),
    ]
    rig.t.load_later("req", targets)
    assert _loaded(rig) == [("req", {13, 14})]
    rig.device.run_all(rig.device.compute)
    assert rig.kv[:, 12].min() == 31
    assert rig.kv[:, 13].min() == rig.kv[:, 13].max() == 99 and rig.kv[:, 14].min() == rig.kv[:, 14].max() == 99
    assert rig.stats.snapshot()["load_failed_values"] == 2


def test_a_full_staging_pool_drops_the_tail_of_a_save_and_never_waits(server):
    rig = Rig(server, slots=3)
    try:
        rig.store.gate.clear()  # slots stay taken while the put waits
        pages = [rig.page(b, f"s{b}") for b in range(5)]
        rig.t.save(pages, ["r"] * 5, reused_next_step=False)  # returns at once: 3 slots for 5 pages
        rig.t.save([rig.page(7, "s7")], ["r"], reused_next_step=False)  # no slot left at all
        counts = rig.stats.snapshot()
        assert counts["save_pages_dropped_staging"] == 2 + 1
        rig.store.gate.set()
        rig.wait_saved()
        assert [rig.stored(f"s{b}") is not None for b in range(5)] == [True, True, True, False, False]
        assert rig.t.save_pool.free_slots() == 3  # every slot came back
    finally:
        rig.close()


def test_a_full_put_queue_drops_the_step_and_never_waits(server):
    rig = Rig(server, jobs_max=1)
    try:
        rig.store.gate.clear()
        rig.t.save([rig.page(0, "q0")], ["r"], reused_next_step=False)
        assert rig.store.started.wait(WAIT_S)  # the thread holds job 1; the queue is empty
        rig.t.save([rig.page(1, "q1")], ["r"], reused_next_step=False)  # queued
        rig.t.save([rig.page(2, "q2")], ["r"], reused_next_step=False)  # full: dropped
        assert rig.stats.snapshot()["save_pages_dropped"] == 1
        rig.store.gate.set()
        rig.wait_saved()
        assert [rig.stored(n) is not None for n in ("q0", "q1", "q2")] == [True, True, False]
    finally:
        rig.close()


def test_values_over_the_segment_limit_round_trip_in_segments(server):
    rig = Rig(server, value_bytes_max=300)
    try:
        assert rig.values.segments == 3  # 768 bytes in pieces of 300
        rig.device.launch(
            rig.device.compute,
            lambda: rig.kv[:, 3].__setitem__(
                slice(None), np.arange(H * N * C, dtype=np.uint32).reshape(H, N, C).astype(np.uint8)
            ),
        )
        rig.t.save([rig.page(3, "seg")], ["r"], reused_next_step=False)
        rig.wait_saved()
        expected = rig.kv[:, 3].copy()
        rig.t.load_later("req", [Page(0, rig.page(3, "seg").keys, 15)])
        assert _loaded(rig) == [("req", set())]
        assert np.array_equal(rig.kv[:, 15], expected)
    finally:
        rig.close()
