"""The connector's scheduler side with a state group (no engine: requests and scheduler outputs
built as vLLM 0.32 hands them over in Mamba "align" mode): states are saved from vLLM's
boundary offers with the exact blocks offered, never from the positional table; a
decode-time boundary extends the chain and saves the attention pages up to it; a request
saves at most gcache_state_boundaries_max boundaries; a hit needs every state at exactly the
cut, loads asynchronously, into the boundary slot."""

from __future__ import annotations

from types import SimpleNamespace

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import GroupTag, prompt_page_hashes, rank_keys
from gcache.integrations.vllm.kv.scheduler_side import SchedulerSide
from gcache.integrations.vllm.kv.settings import ConnectorSettings
from gcache.integrations.vllm.kv.state_groups import StateSpec
from gcache.integrations.vllm.kv.stats import ConnectorStats

BS = 16
STATE = StateSpec("mamba2", ((3, 160), (4, 32, 16)), ("float32", "float32"), "default", "align", 0)


class Store:
    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.down = False

    def exists_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n

    def exists_flags(self, keys: list[bytes]) -> list[bool]:
        return [k in self.held for k in keys]


class Events:
    def __init__(self) -> None:
        self.saved_pages: list = []

    def saved(self, pages) -> None:
        self.saved_pages += pages

    def missing(self, pages) -> None:
        pass


def side(events=None, **settings):
    groups = [
        Group(0, AttentionKind.STATE, ("l0",), (0,), BS, 0, "mamba", None, STATE),
        Group(1, AttentionKind.FULL, ("l1",), (1,), BS, 0, "full_attention", None),
    ]
    s = SchedulerSide(
        ConnectorSettings(url="127.0.0.1:1", **settings),
        groups,
        rank_keys("m", None, 1, False),
        Store(),  # type: ignore[arg-type]  # GuardedStore's calls, in memory
        ConnectorStats(),
        load=True,
        save=True,
        events=events,
    )
    s.set_tags({0: {0: GroupTag("st", 1), 1: GroupTag("kv", 1)}})
    return s


def request(tokens: list[int], prompt_len: int, rid: str = "r"):
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=tokens[:prompt_len], all_token_ids=tokens, cache_salt=None, lora_request=None
    )


def output(new=(), cached=(), offers=None, scheduled=None):
    """new: (req_id, block_ids per group, computed); cached: (req_id, new block ids, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[b for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled or {},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers or {}),
        preempted_req_ids=set(),
    )


def saved(meta, group: int) -> list[tuple[str, int]]:
    return [(r.page_hash, r.block_id) for spec in meta.saves for r in spec.pages if r.group == group]


def test_states_come_from_the_offers_and_decode_boundaries_extend_the_chain():
    s = side()
    tokens = list(range(1, 80))  # a 40-token prompt, then 39 decoded tokens
    req = request(tokens, 40)
    s.matched_tokens(req, 0)
    hashes = prompt_page_hashes(tokens, BS)
    # Prefill 32 of 40: vLLM offers the state at 32 in block 7; its table says otherwise
    # (the positional slot 1 holds block 2): the offered block is saved.
    meta = s.build_meta(
        output(new=[("r", [[0, 2, 5], [10, 11, 12]], 0)], offers={"r": [(0, 7, 32)]}, scheduled={"r": 32})
    )
    assert saved(meta, 0) == [(hashes[1], 7)]
    assert saved(meta, 1) == [(hashes[0], 10), (hashes[1], 11)]
    # Decoding reaches 64: the state there, and the attention pages up to it (past the prompt).
    meta = s.build_meta(
        output(cached=[("r", [[], [13]], 63)], offers={"r": [(0, 9, 64), (1, 99, 64)]}, scheduled={"r": 1})
    )
    assert saved(meta, 0) == [(hashes[3], 9)]  # group 1 is not a state group: its offer is ignored
    assert saved(meta, 1) == [(hashes[2], 12), (hashes[3], 13)]
    assert s.stats.snapshot()["state_values_offered"] == 2


def test_a_request_saves_at_most_its_bound_of_boundaries():
    s = side(state_boundaries_max=1, state_admission="offered")
    tokens = list(range(1, 80))
    s.matched_tokens(request(tokens, 70), 0)
    meta = s.build_meta(
        output(
            new=[("r", [[1, 2, 3, 4], [5, 6, 7, 8]], 0)], offers={"r": [(0, 2, 32), (0, 4, 64)]}, scheduled={"r": 64}
        )
    )
    assert [b for _, b in saved(meta, 0)] == [2]
    assert s.stats.snapshot()["state_values_over_bound"] == 1


def blocks(rows):
    return SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, is_null=b == 0) for b in row] for row in rows])


def test_a_hit_needs_the_state_at_exactly_the_cut_and_loads_it_into_the_boundary_slot():
    s = side(async_load_min_tokens=1 << 20)
    tokens = list(range(1, 71))
    hashes = prompt_page_hashes(tokens, BS)  # 4 full pages
    keys = rank_keys("m", None, 1, False)[0]
    state_group, full_group = s.groups
    s.store.held.update(keys.value_keys(h, full_group, GroupTag("kv", 1))[0] for h in hashes)  # type: ignore[attr-defined]
    assert s.matched_tokens(request(tokens, 70), 0) == (0, False)  # pages but no state: a miss
    s.tracks.clear()
    s.store.held.add(keys.value_keys(hashes[1], state_group, GroupTag("st", 1))[0])  # type: ignore[attr-defined]
    tokens_hit, asynchronous = s.matched_tokens(request(tokens, 70), 0)
    assert (tokens_hit, asynchronous) == (32, True)  # the state at 32; states always load between steps
    s.after_alloc(request(tokens, 70), blocks([[0, 9], [3, 4]]), 32)
    (load,) = s.pending_loads
    assert load.asynchronous
    assert {(r.group, r.page_hash, r.block_id) for r in load.pages} == {
        (0, hashes[1], 9),
        (1, hashes[0], 3),
        (1, hashes[1], 4),
    }


def test_ends_admission_keeps_the_prompt_end_decode_boundaries_and_the_branch_point():
    tokens = list(range(1, 120))
    hashes = prompt_page_hashes(tokens, BS)
    full_keys = rank_keys("m", None, 1, False)[0]
    # (pages stored before the lookup: the branch point, boundaries whose states are saved)
    for stored, boundaries in ((0, [5, 6]), (2, [2, 5, 6])):
        s = side(state_admission="ends")
        s.store.held.update(full_keys.value_keys(h, s.groups[1], GroupTag("kv", 1))[0] for h in hashes[:stored])  # type: ignore[attr-defined]
        s.matched_tokens(request(tokens, 90), 0)  # prompt 90: its last full boundary is 80 (5 pages)
        offers = {"r": [(0, 1, 32), (0, 2, 48), (0, 3, 80), (0, 4, 96)]}  # 96: reached decoding
        meta = s.build_meta(output(new=[("r", [[0] * 6, list(range(10, 16))], 0)], offers=offers, scheduled={"r": 96}))
        assert [h for h, _ in saved(meta, 0)] == [hashes[b - 1] for b in boundaries]


def test_states_are_not_cached_without_align_mode_or_with_speculative_blocks():
    from gcache.integrations.vllm.kv.state_groups import why_not_served

    assert why_not_served([STATE]) is None
    assert "align" in (why_not_served([STATE._replace(cache_mode="none")]) or "")
    assert "speculative" in (why_not_served([STATE._replace(speculative_blocks=1)]) or "")


def test_a_state_models_pages_and_states_are_announced():
    """Its attention pages as their group's blocks, and each saved state as one block of its
    state group (kind "mamba") at the page it ends: a router credits up to that boundary."""
    events = Events()
    s = side(events=events)
    tokens = list(range(1, 41))
    req = request(tokens, 40)
    req.block_hashes, req.num_tokens = [bytes([i]) * 32 for i in range(2)], 40
    s.matched_tokens(req, 0)
    meta = s.build_meta(
        output(new=[("r", [[0, 2, 5], [10, 11, 12]], 0)], offers={"r": [(0, 7, 32)]}, scheduled={"r": 40})
    )
    assert saved(meta, 1) and saved(meta, 0) == [(prompt_page_hashes(tokens, BS)[1], 7)]
    announced = [(p.group_idx, p.kind, p.block_hash, p.parent_hash, list(p.token_ids)) for p in events.saved_pages]
    h = req.block_hashes
    assert announced == [
        (1, "full_attention", h[0], None, tokens[:16]),
        (1, "full_attention", h[1], h[0], tokens[16:32]),
        (0, "mamba", h[1], h[0], tokens[16:32]),  # the state after pages 0-1
    ]
    assert all(p.keys for p in events.saved_pages)  # what the source confirms in the store first
