"""The worker saves nothing computed while a failed load's blocks may still be read (issue 37):
the step whose load failed and, when vLLM schedules a step before it has read the last one's
output (async scheduling), the next step too. The real-engine case (a synchronous load whose
page fails its checksum, then another engine loading the prompt) is
test_vllm_failed_load_saves.py; this is the step count, with a
recorder in place of the transfers (their saves are tests/client/test_vllm_transfers.py's)."""

from __future__ import annotations

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import GroupTag, PageKeys
from gcache.integrations.vllm.kv.meta import GCacheConnectorMetadata, PageRef, SaveSpec
from gcache.integrations.vllm.kv.settings import ConnectorSettings
from gcache.integrations.vllm.kv.stats import ConnectorStats
from gcache.integrations.vllm.kv.worker_side import WorkerSide


class SavesSeen:
    def __init__(self) -> None:
        self.blocks: list[list[int]] = []

    def save(self, pages, req_ids, reused_next_step: bool) -> None:
        self.blocks.append([p.block_id for p in pages])


def worker(steps_scheduled_ahead: int) -> tuple[WorkerSide, SavesSeen]:
    settings = ConnectorSettings.from_extra_config({"gcache_url": "127.0.0.1:1"})
    group = Group(0, AttentionKind.FULL, ("a",), (0,), 16, 0)
    side = WorkerSide(
        settings,
        [group],
        PageKeys("m", None, 0, 1, False),
        None,  # no client, no store: the recorder saves
        None,  # type: ignore[arg-type]
        ConnectorStats(),
        8,
        steps_scheduled_ahead=steps_scheduled_ahead,
    )
    side.tags = {0: GroupTag("t", 1)}
    seen = SavesSeen()
    side.transfers = seen  # type: ignore[assignment]
    return side, seen


def step(side: WorkerSide, block: int, failed: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    side.load_errors |= failed  # what start_load of this step found
    side.save_step(GCacheConnectorMetadata(saves=[SaveSpec(f"r{block}", (PageRef(0, f"h{block}", block, 16),))]))
    side.take_load_errors()  # vLLM reads them after the step


def test_the_step_of_a_failed_load_saves_nothing():
    side, seen = worker(0)
    step(side, 1)
    step(side, 2, failed={7})
    step(side, 3)
    assert seen.blocks == [[1], [3]]
    assert side.stats.snapshot()["save_pages_dropped_load_failed"] == 1
    assert side.saving == {"r1", "r2", "r3"}  # each still reported sent (nothing holds its blocks)


def test_with_async_scheduling_the_next_step_saves_nothing_either():
    side, seen = worker(1)
    step(side, 1, failed={7})
    step(side, 2)
    step(side, 3)
    assert seen.blocks == [[3]]
    assert side.stats.snapshot()["save_pages_dropped_load_failed"] == 2
