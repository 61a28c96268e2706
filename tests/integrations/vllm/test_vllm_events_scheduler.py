"""The connector's scheduler side as the L3 events' source (no vLLM: requests and scheduler
outputs built as vLLM 0.32 hands them over): the pages it plans to save go to the source with
vLLM's block hashes, their parents, tokens and group (a hybrid model's sliding group only its
checkpoint tails); a lookup's first missing page is reported; nothing while the store is down;
requests whose hashes a consumer could not match (a cache salt) are not announced."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.events.source import Page
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import GroupTag, rank_keys
from gcache.integrations.vllm.kv.plan import prompt_tail_pages, sliding_tail_pages
from gcache.integrations.vllm.kv.scheduler_side import SchedulerSide
from gcache.integrations.vllm.kv.settings import ConnectorSettings
from gcache.integrations.vllm.kv.stats import ConnectorStats

BS = 16
WINDOW = 24
LOG = logging.getLogger("test")


class Store:
    """Holds the keys in `held`; `down` as the guarded store says it."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.down = False

    def exists_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held and not self.down:
            n += 1
        return n

    def exists_flags(self, keys: list[bytes]) -> list[bool]:
        return [k in self.held and not self.down for k in keys]


class Events:
    """The source's scheduler-facing half, recorded."""

    def __init__(self) -> None:
        self.saved_pages: list[Page] = []
        self.missing_pages: list[Page] = []

    def saved(self, pages: list[Page]) -> None:
        self.saved_pages += pages

    def missing(self, pages: list[Page]) -> None:
        self.missing_pages += pages


def vhash(p: int, salt: bytes = b"") -> bytes:
    return bytes([p + 1]) * 31 + salt[:1].ljust(1, b"\0")


def side(hybrid: bool):
    groups = [Group(0, AttentionKind.FULL, ("l0",), (0,), BS, 0, "full_attention", None)]
    if hybrid:
        groups.append(
            Group(1, AttentionKind.SWA, ("l1",), (1,), BS, sliding_tail_pages(WINDOW, BS), "sliding_window", WINDOW)
        )
    settings = ConnectorSettings(url="127.0.0.1:1", checkpoint_pages=4)
    store, events = Store(), Events()
    s = SchedulerSide(
        settings,
        groups,
        rank_keys("m", None, 2, False),
        store,  # type: ignore[arg-type]  # GuardedStore's calls, in memory
        ConnectorStats(),
        load=True,
        save=True,
        events=events,  # type: ignore[arg-type]
        hash_of=lambda h: int.from_bytes(h, "big") & ((1 << 64) - 1),
    )
    s.set_tags({0: {g.index: GroupTag(f"t{g.index}", 1) for g in groups}})
    return s, store, events


def request(req_id: str, n: int, **kw):
    tokens = list(range(100, 100 + n))
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        block_hashes=[vhash(p) for p in range(n // BS)],
        num_tokens=n,
        mm_features=None,
        lora_request=None,
        cache_salt=kw.get("cache_salt"),
    )


def schedule(s: SchedulerSide, req, groups: int):
    """vLLM's steps for a new request computed in one step: lookup, allocation, metadata."""
    s.matched_tokens(req, 0)
    n = len(req.prompt_token_ids)
    new = SimpleNamespace(
        req_id=req.request_id, block_ids=[list(range(1, n // BS + 2))] * groups, num_computed_tokens=0
    )
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    out = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={new.req_id: n})
    return s.build_meta(out)


def hint(p: int) -> int:
    return int.from_bytes(vhash(p), "big") & ((1 << 64) - 1)


def test_saved_pages_go_to_the_source_with_vllms_names():
    s, _, events = side(hybrid=False)
    req = request("r1", 5 * BS + 3)
    meta = schedule(s, req, 1)
    assert len(meta.saves[0].pages) == 5
    pages = events.saved_pages
    assert [p.block_hash for p in pages] == [hint(i) for i in range(5)]
    assert [p.parent_hash for p in pages] == [None] + [hint(i) for i in range(4)]
    assert [list(p.token_ids) for p in pages] == [req.prompt_token_ids[i * BS : (i + 1) * BS] for i in range(5)]
    assert {(p.group_idx, p.kind, p.window, p.block_size) for p in pages} == {(0, "full_attention", None, BS)}
    assert all(len(p.keys) == 2 for p in pages)  # both TP ranks' values of the page


def test_a_hybrid_models_sliding_group_announces_its_checkpoint_tails_only():
    s, _, events = side(hybrid=True)
    n = 9 * BS + 3
    schedule(s, request("r1", n), 2)
    swa = sorted(p.block_hash for p in events.saved_pages if p.group_idx == 1)
    tails = prompt_tail_pages(n, BS, 4, sliding_tail_pages(WINDOW, BS))
    assert swa == sorted(hint(p) for p in tails) and len(tails) < 9
    assert {(p.kind, p.window) for p in events.saved_pages if p.group_idx == 1} == {("sliding_window", WINDOW)}


def test_a_lookup_reports_the_first_missing_page_unless_the_store_is_down():
    s, store, events = side(hybrid=False)
    req = request("r1", 6 * BS + 1)
    s.matched_tokens(req, 0)
    track = s.tracks["r1"]
    for p in range(3):
        store.held.update(s._keys([track.hashes[p]], s.groups[0]))
    assert s.matched_tokens(req, 0)[0] == 3 * BS
    assert [(p.group_idx, p.block_hash) for p in events.missing_pages][-1] == (0, hint(3))
    before = len(events.missing_pages)
    store.down = True
    assert s.matched_tokens(req, 0)[0] == 0
    assert len(events.missing_pages) == before


def test_a_request_with_a_cache_salt_is_saved_but_not_announced():
    s, _, events = side(hybrid=False)
    meta = schedule(s, request("r1", 3 * BS, cache_salt="tenant-a"), 1)
    assert len(meta.saves[0].pages) == 3 and events.saved_pages == []
