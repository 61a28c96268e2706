"""cache_ttft (policies.CacheTTFT): the estimated-TTFT cost on hand-built views, against the
seed's score (cache_aware) on the same views. Every expected worker and cost is exact."""

from __future__ import annotations

import pytest

from gcache.router.config import RouterConfig
from gcache.router.policies import CacheAware, CacheTTFT, Candidate, Prompt
from gcache.serving.redis_layout import L1_FULL, L1_SWA, L2_FULL, L2_SWA, Registration, WorkerLoad, page_ids

PS, W = 8, 32  # 4 pages of window
A, B = "http://a", "http://b"
CONV = list(range(10, 10 + 8 * 100 + 1))  # 801 tokens: a conversation's next turn, 100 whole pages
IDS = page_ids(CONV, PS)


def reg(url, running=0, waiting=0, queued=0):
    return Registration(url, "m", PS, W, "e", 1, 0, WorkerLoad(running, waiting, queued, 0, 32))


def cand(url, flags=None, rank=0, inflight=0, **load):
    return Candidate(url, rank, inflight, 0, reg(url, **load), flags or {})


def held(n, swa=True, full=L1_FULL, swa_bit=L1_SWA):
    """The first n pages of CONV, with SWA KV on every page (window-safe at n) or on none."""
    return {IDS[i]: full | (swa_bit if swa else 0) for i in range(n)}


def prompt(tokens=CONV):
    return Prompt(len(tokens), lambda ps: page_ids(tokens, ps), {}, PS)


def cfg(**kw):
    return RouterConfig(workers=(A,), recent_ttl_s=0, ttft_running_tokens=16.0, **kw)


def test_conversation_stays_home_under_moderate_load_where_the_seed_score_hops():
    # A: the history (90 pages = 720 of 801 tokens), 3 running, 200 queued tokens.
    # B: only the shared system prompt (50 pages = 400 tokens), idle.
    home, other = cand(A, held(90), rank=1, running=3, queued=200), cand(B, held(50), rank=2)
    mode, s = CacheTTFT(cfg()).evaluate(prompt(), [home, other])
    assert mode == "cache"
    assert (s[A]["own_tokens"], s[A]["queue_tokens"]) == (81, 200 + 16 * 3)
    assert (s[B]["own_tokens"], s[B]["queue_tokens"]) == (401, 0)
    assert CacheTTFT(cfg()).choose(prompt(), [home, other]).url == A
    # The seed's score on the same view: 2 * 720/801 - 1 < 2 * 400/801 - 0, so it leaves home.
    seed = CacheAware(cfg()).choose(prompt(), [home, other])
    assert seed.url == B and seed.scores[A]["score"] == pytest.approx(2 * 720 / 801 - 1.0)


def test_conversation_moves_when_home_is_heavily_loaded():
    other = cand(B, held(50), rank=2, running=1)
    home = cand(A, held(90), rank=1, running=6, waiting=4, queued=4000)
    choice = CacheTTFT(cfg()).choose(prompt(), [home, other])
    assert choice.url == B
    # 10 requests ahead, each delays this 81-token prefill by at most 81 tokens (shortest first).
    assert choice.scores[A]["score"] == -(81 + min(4000, 10 * 81) + 16 * 10)
    assert choice.scores[B]["score"] == -(401 + 16)
    # The cost is exact, not a threshold: 175 queued tokens at home and it stays; at 176 it is a
    # tie (417 both), which goes to the higher rank, B.
    at = lambda q: (
        CacheTTFT(cfg()).choose(prompt(), [cand(A, held(90), rank=1, running=6, waiting=4, queued=q), other]).url
    )
    assert (at(175), at(176)) == (A, B)
    # A fully cached turn (1 token to compute) stays home behind any queue: it goes first there.
    assert (
        CacheTTFT(cfg()).choose(prompt(), [cand(A, held(100), rank=1, running=6, waiting=4, queued=4000), other]).url
        == A
    )


def test_a_worker_whose_swa_kv_was_evicted_is_not_credited():
    # A holds all 100 pages in full KV but no SWA KV anywhere: no window-safe point, nothing usable.
    swa_gone, b = cand(A, held(100, swa=False), rank=9), cand(B, held(60), rank=1)
    choice = CacheTTFT(cfg()).choose(prompt(), [swa_gone, b])
    assert choice.url == B
    assert (choice.scores[A]["l1"], choice.scores[A]["raw_overlap"], choice.scores[A]["own_tokens"]) == (0, 800, 801)
    assert choice.scores[B]["l1"] == 480


def test_host_tier_tokens_cost_their_copy():
    l2 = cand(A, held(100, full=L2_FULL, swa_bit=L2_SWA), rank=1)
    _, s = CacheTTFT(cfg(tier_weights=(1.0, 0.75, 0.5))).evaluate(prompt(), [l2, cand(B, held(60), rank=2)])
    assert s[A]["l2"] == 800 and s[A]["own_tokens"] == pytest.approx(801 - 0.75 * 800)


def test_requests_sent_but_not_yet_published_count_at_their_estimate():
    pol = CacheTTFT(cfg())
    fresh = list(range(5000, 5000 + 801))  # matches nowhere: 801 uncached tokens on either worker
    first = pol.choose(prompt(fresh), [cand(A, rank=2), cand(B, rank=1)])
    assert first.url == A  # a tie: rank
    pol.commit(prompt(fresh), A)
    # A's published load still says idle, but this router has one request in flight there.
    s = pol.choose(prompt(fresh), [cand(A, rank=2, inflight=1), cand(B, rank=1)]).scores
    assert s[A]["queue_tokens"] == 801 + 16 and s[B]["queue_tokens"] == 0
    # Once A publishes that request (running 1, its tokens queued), it is not counted twice.
    s = pol.evaluate(prompt(fresh), [cand(A, rank=2, inflight=1, running=1, queued=801), cand(B, rank=1)])[1]
    assert s[A]["queue_tokens"] == 801 + 16
