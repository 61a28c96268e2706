"""The policies' arithmetic and decisions on hand-built views (no Redis: state.py and
test_router_core.py cover how views are built). Every expected worker is exact."""

from __future__ import annotations

import pytest

from gcache.router.config import RouterConfig
from gcache.router.match import match_worker
from gcache.router.policies import ApproxTree, CacheAware, Candidate, Dynamo, Prompt, Random, RoundRobin
from gcache.serving.redis_layout import (
    L1_FULL,
    L1_SWA,
    L2_FULL,
    L2_SWA,
    L3_FULL,
    L3_SWA,
    Registration,
    WorkerLoad,
    page_ids,
)

PS, W = 8, 32  # 4 pages of window
A, B, C = "http://a", "http://b", "http://c"
PROMPT = list(range(10, 10 + 8 * 10 + 1))  # 81 tokens: 10 whole pages, match limit 10 pages
IDS = page_ids(PROMPT, PS)


def reg(url: str, running: int = 0, waiting: int = 0, queued: int = 0, active: int = 0) -> Registration:
    return Registration(url, "m", PS, W, "e", 1, 0, WorkerLoad(running, waiting, queued, active, 32))


def cand(url: str, flags=None, rank: int = 0, inflight: int = 0, **load) -> Candidate:
    return Candidate(url, rank, inflight, 0, reg(url, **load), flags or {})


def prompt(tokens=PROMPT, l3=None) -> Prompt:
    return Prompt(len(tokens), lambda ps: page_ids(tokens, ps), l3 or {}, PS)


def pages(n: int, swa_from: int | None = None, full=L1_FULL, swa=L1_SWA) -> dict:
    """Flags for the first n pages of IDS, SWA on pages >= swa_from."""
    return {IDS[i]: full | (swa if swa_from is not None and i >= swa_from else 0) for i in range(n)}


def test_window_safe_ends_per_tier():
    # L1: 6 pages, SWA only on pages 2..5 -> safe at 6 (tail of 6 = pages 2..5).
    flags = pages(6, swa_from=2)
    # L2 continues with pages 6..8, SWA on 7, 8 only: from 6, end 9 needs pages 6..8 (>= start) live -> no;
    # end 8 needs pages 6, 7 -> no; so L2 adds nothing ...
    for i in (6, 7, 8):
        flags[IDS[i]] = L2_FULL | (L2_SWA if i >= 7 else 0)
    m = match_worker(IDS, 10, flags, {}, PS, W)
    assert (m.l1, m.l2, m.l3, m.raw_l1, m.raw_host) == (6, 6, 6, 6, 3)
    flags[IDS[6]] |= L2_SWA  # ... until page 6 has its SWA: then 9 is window-safe
    assert match_worker(IDS, 10, flags, {}, PS, W).l2 == 9
    l3 = {IDS[9]: L3_FULL | L3_SWA}
    assert match_worker(IDS, 10, flags, l3, PS, W).l3 == 10
    assert match_worker(IDS, 9, flags, l3, PS, W).l3 == 9  # never past the limit


def test_a_tombstone_in_the_window_cuts_back_to_the_last_checkpoint():
    flags = pages(10, swa_from=0)
    flags[IDS[8]] = L1_FULL  # tombstone: ends 9..12 lose their window
    m = match_worker(IDS, 10, flags, {}, PS, W)
    assert (m.l1, m.raw_l1) == (8, 10)


def test_cache_aware_score_and_imbalance_guard():
    cfg = RouterConfig(workers=(A,), match_weight=2.0, balance_abs_threshold=8, balance_rel_threshold=1.5)
    pol = CacheAware(cfg)
    a = cand(A, pages(10, swa_from=6), running=4)  # 10 pages window-safe: 80 of 81 tokens
    b = cand(B, {}, running=2)
    mode, s = pol.evaluate(prompt(), [a, b])
    assert mode == "cache"
    assert s[A]["l1"] == 80 and s[A]["score"] == pytest.approx(2.0 * 80 / 81 - 4 / 4)
    assert s[B]["score"] == pytest.approx(0 - 2 / 4)
    assert pol.choose(prompt(), [a, b]).url == A
    a = cand(A, pages(10, swa_from=6), running=12)  # 12 - 2 > 8 and 12 > 2 * 1.5: by load
    choice = pol.choose(prompt(), [a, b])
    assert (choice.url, choice.mode) == (B, "load")


def test_cache_aware_weights_tiers_and_counts_l3_for_everyone():
    cfg = RouterConfig(workers=(A,), tier_weights=(1.0, 0.5, 0.25))
    l2_only = {IDS[i]: L2_FULL | (L2_SWA if i >= 6 else 0) for i in range(10)}
    l3 = {IDS[i]: L3_FULL | (L3_SWA if i >= 6 else 0) for i in range(10)}
    _, s = CacheAware(cfg).evaluate(prompt(l3=l3), [cand(A, pages(10, swa_from=6)), cand(B, l2_only), cand(C)])
    assert (s[A]["l1"], s[B]["l2"], s[C]["l3"]) == (80, 80, 80)
    assert s[A]["score"] > s[B]["score"] > s[C]["score"] > 0


def test_dynamo_cost_is_raw_overlap_and_swa_unaware():
    cfg = RouterConfig(workers=(A,), dynamo_overlap_weight=1.0, dynamo_host_weight=0.5)
    a = cand(A, pages(10), queued=16, active=80)  # no SWA at all: window-safe match 0
    b = cand(B, pages(4, swa_from=0) | {IDS[i]: L2_FULL for i in range(4, 8)})
    mode, s = Dynamo(cfg).evaluate(prompt(), [a, b])
    # A: overlap 10 blocks -> new 1 token; prefill (1 + 16) / 8; decode (80 + 1) / 8.
    assert s[A]["score"] == pytest.approx(-((1 + 16) / 8 + (80 + 1) / 8))
    # B: 4 L1 + 0.5 * 4 host = 6 blocks -> new 33 tokens; prefill 33 / 8; decode 33 / 8.
    assert s[B]["score"] == pytest.approx(-(33 / 8 + 33 / 8))
    assert Dynamo(cfg).choose(prompt(), [a, b]).url == B
    assert Dynamo(cfg).choose(prompt(), [cand(A, pages(10), active=8), b]).url == A  # SWA ignored


def test_ties_go_to_the_higher_rank():
    cfg = RouterConfig(workers=(A,))
    cands = [cand(A, rank=5), cand(B, rank=9), cand(C, rank=1)]
    assert CacheAware(cfg).choose(prompt(), cands).url == B
    assert Dynamo(cfg).choose(prompt(), cands).url == B


def test_approx_tree_follows_its_own_decisions():
    cfg = RouterConfig(
        workers=(A,), page_size=PS, approx_cache_threshold=0.5, approx_balance_abs_threshold=2, approx_max_pages=12
    )
    pol = ApproxTree(cfg)
    cands = lambda **inflight: [Candidate(u, r, inflight.get(u[-1], 0)) for u, r in ((A, 1), (B, 2))]
    first = pol.choose(prompt(), cands())
    assert (first.url, first.mode) == (B, "capacity")  # empty trees: tie -> rank
    pol.commit(prompt(), first.url)
    again = pol.choose(prompt(), cands())
    assert (again.url, again.mode) == (B, "cache")
    other = list(range(500, 581))
    c = pol.choose(prompt(other), cands())
    assert (c.url, c.mode) == (A, "capacity")  # no match: the smaller tree
    pol.commit(prompt(other), c.url)
    half = PROMPT[:48] + list(range(700, 733))  # 6 of 10 pages shared with PROMPT: 0.6 > 0.5
    assert pol.choose(prompt(half), cands()).url == B
    assert pol.choose(prompt(half), cands(b=4)).mode == "load"  # 4 - 0 > 2: least load
    assert pol.choose(prompt(half), cands(b=4)).url == A
    pol.commit(prompt(list(range(900, 981))), B)  # 10 more pages: LRU cuts B's tree to 12
    assert len(pol.trees[B]) == 12


def test_round_robin_and_random_are_reproducible():
    cfg = RouterConfig(workers=(A,), seed=3)
    rr = RoundRobin(cfg)
    got = []
    for _ in range(4):
        ch = rr.choose(prompt(), [cand(C), cand(A), cand(B)])
        rr.commit(prompt(), ch.url)
        got.append(ch.url)
    assert got == [A, B, C, A]
    r1, r2 = Random(cfg), Random(cfg)
    assert [r1.choose(prompt(), [cand(A), cand(B)]).url for _ in range(8)] == [
        r2.choose(prompt(), [cand(B), cand(A)]).url for _ in range(8)
    ]


def test_cache_aware_credits_the_end_of_a_prompt_it_just_sent_until_it_expires():
    cfg = RouterConfig(workers=(A,), recent_ttl_s=5.0)
    pol = CacheAware(cfg)
    cands = [cand(A, rank=9), cand(B, rank=1)]
    first = Prompt(len(PROMPT), lambda ps: page_ids(PROMPT, ps), {}, PS, now=100.0)
    assert pol.choose(first, cands).url == A  # nothing known: rank
    pol.commit(first, B)  # (the server sent it to B, e.g. A failed)
    turn2 = PROMPT + list(range(300, 340))  # starts with all of PROMPT's 10 whole pages
    at = lambda now, toks=turn2: Prompt(len(toks), lambda ps: page_ids(toks, ps), {}, PS, now=now)
    choice = pol.choose(at(104.9), cands)
    assert choice.url == B and choice.scores[B]["l1"] == 80 and choice.scores[A]["l1"] == 0
    assert pol.choose(at(105.0), cands).url == A  # expired: the published view decides again
    cut = PROMPT[:60] + list(range(300, 340))  # shares 7 pages, not the end: no credit mid-way
    assert pol.choose(at(101.0, cut), cands).scores[B]["l1"] == 0
