"""The scheduler side's "last page" rule (plan.loadable_pages), without an engine: requests,
blocks and scheduler outputs built as vLLM 0.32 hands them over. A full-attention prompt that
ends on a page boundary loads all its pages and reports prompt - 1 tokens; the allocation
then covers the last page (whole pages, rounded up) and the step computing the last token
saves nothing it loaded; a prompt ending mid-page, the setting off, a sliding-window group or
a state group keep the old hit (the last page recomputed). The engine test is
test_vllm_last_page.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import GroupTag, prompt_page_hashes, rank_keys
from gcache.integrations.vllm.kv.plan import sliding_tail_pages
from gcache.integrations.vllm.kv.scheduler_side import SchedulerSide
from gcache.integrations.vllm.kv.settings import ConnectorSettings
from gcache.integrations.vllm.kv.state_groups import StateSpec
from gcache.integrations.vllm.kv.stats import ConnectorStats

BS = 16
PAGES = 4
STATE = StateSpec("mamba2", ((3, 160), (4, 32, 16)), ("float32", "float32"), "default", "align", 0)
SYNC = dict(async_load_min_tokens=1 << 20)


class Store:
    """Holds every key (all pages stored, every group)."""

    down = False

    def exists_prefix(self, keys: list[bytes]) -> int:
        return len(keys)

    def exists_flags(self, keys: list[bytes]) -> list[bool]:
        return [True] * len(keys)


def side(kinds: tuple[str, ...] = ("full",), **settings) -> SchedulerSide:
    groups = []
    for i, kind in enumerate(kinds):
        if kind == "full":
            groups.append(Group(i, AttentionKind.FULL, (f"l{i}",), (i,), BS, 0, "full_attention", None))
        elif kind == "swa":
            tail = sliding_tail_pages(24, BS)
            groups.append(Group(i, AttentionKind.SWA, (f"l{i}",), (i,), BS, tail, "sliding_window", 24))
        else:
            groups.append(Group(i, AttentionKind.STATE, (f"l{i}",), (i,), BS, 0, "mamba", None, STATE))
    s = SchedulerSide(
        ConnectorSettings(url="127.0.0.1:1", **{**SYNC, **settings}),
        groups,
        rank_keys("m", None, 1, False),
        Store(),  # type: ignore[arg-type]  # GuardedStore's calls, in memory
        ConnectorStats(),
        load=True,
        save=True,
    )
    s.set_tags({0: {g.index: GroupTag(f"t{g.index}", 1) for g in groups}})
    return s


def request(n: int, rid: str = "r"):
    tokens = list(range(1, n + 1))
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens, cache_salt=None, lora_request=None
    )


def blocks(groups: int, pages: int):
    row = [SimpleNamespace(block_id=10 + p, is_null=False) for p in range(pages)]
    return SimpleNamespace(blocks=[row] * groups)


def step(s: SchedulerSide, computed: int, scheduled: int, groups: int = 1, pages: int = PAGES):
    """The request's first scheduled step, `computed` tokens already there."""
    new = SimpleNamespace(req_id="r", block_ids=[list(range(10, 10 + pages))] * groups, num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return s.build_meta(
        SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"r": scheduled})
    )


@pytest.mark.parametrize("local", [0, 1, PAGES - 1])
def test_a_prompt_on_a_page_boundary_loads_every_page_and_reports_prompt_minus_one(local, caplog):
    s = side()
    n = PAGES * BS
    req = request(n)
    tokens, asynchronous = s.matched_tokens(req, local * BS)
    assert (tokens, asynchronous) == (n - 1 - local * BS, False)
    with caplog.at_level(logging.WARNING, logger="gcache.integrations.vllm"):
        s.after_alloc(req, blocks(1, PAGES), tokens)
    assert not caplog.records  # vLLM's allocation agrees with the plan
    (load,) = s.pending_loads
    hashes = prompt_page_hashes(req.prompt_token_ids, BS)
    assert [(r.page_hash, r.block_id) for r in load.pages] == [(hashes[p], 10 + p) for p in range(local, PAGES)]
    # vLLM computes the last token alone: nothing loaded is saved again.
    meta = step(s, n - 1, 1)
    assert meta.loads == [load] and meta.saves == []


def test_an_async_load_of_the_last_page_saves_nothing_it_loaded_either():
    s = side(async_load_min_tokens=1)
    req = request(PAGES * BS)
    assert s.matched_tokens(req, 0) == (PAGES * BS - 1, True)
    s.after_alloc(req, blocks(1, PAGES), PAGES * BS - 1)
    assert len(s.pending_loads[0].pages) == PAGES and s.pending_loads[0].asynchronous
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    idle = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})
    assert len(s.build_meta(idle).loads) == 1  # the load runs between steps: the request is not scheduled
    assert step(s, PAGES * BS - 1, 1).saves == []


def test_a_failed_load_of_the_last_page_saves_what_vllm_recomputes():
    s = side(async_load_min_tokens=1)
    req = request(PAGES * BS)
    s.matched_tokens(req, 0)
    s.after_alloc(req, blocks(1, PAGES), PAGES * BS - 1)
    s.worker_output(SimpleNamespace(failed_recving={"r"}, invalid_block_ids=set()))
    meta = step(s, 0, PAGES * BS)  # vLLM recomputes the prompt: every page is saved
    assert [r.block_id for r in meta.saves[0].pages] == [10 + p for p in range(PAGES)]


def test_a_prompt_ending_mid_page_keeps_whole_page_hits():
    s = side()
    req = request(PAGES * BS + 5)
    assert s.matched_tokens(req, 0) == (PAGES * BS, False)
    s.after_alloc(req, blocks(1, PAGES + 1), PAGES * BS)
    assert len(s.pending_loads[0].pages) == PAGES
    meta = step(s, PAGES * BS, 5, pages=PAGES + 1)
    assert meta.saves == []  # the last, partial page is not a page to save


@pytest.mark.parametrize(
    "kinds, settings",
    [(("full",), dict(load_last_page=False)), (("swa", "full"), {}), (("state", "full"), {})],
    ids=["setting-off", "sliding-window", "state"],
)
def test_otherwise_the_last_page_is_recomputed_and_saved(kinds, settings):
    s = side(kinds, **settings)
    assert not s.last_page
    req = request(PAGES * BS)
    tokens, _ = s.matched_tokens(req, 0)
    assert tokens == (PAGES - 1) * BS  # never the page holding the last token
    s.after_alloc(req, blocks(len(kinds), PAGES), tokens)
    attention = [r for r in s.pending_loads[0].pages if s.groups[r.group].kind == AttentionKind.FULL]
    assert [r.block_id for r in attention] == [10 + p for p in range(PAGES - 1)]
    meta = step(s, tokens, BS, groups=len(kinds))
    saved = [r for r in meta.saves[0].pages if s.groups[r.group].kind == AttentionKind.FULL]
    assert [r.block_id for r in saved] == [10 + PAGES - 1]  # the recomputed last page


def test_an_allocation_shorter_than_the_plan_loads_only_its_pages(caplog):
    s = side()
    req = request(PAGES * BS)
    s.matched_tokens(req, 0)
    with caplog.at_level(logging.WARNING, logger="gcache.integrations.vllm"):
        s.after_alloc(req, blocks(1, PAGES), 2 * BS)
    assert "planned 4 pages" in caplog.text
    assert [r.block_id for r in s.pending_loads[0].pages] == [10, 11]
