"""A hybrid (Mamba / linear-attention) model's L3 through the router's real ingest and Redis:
its connector announces attention pages (group 0) and boundary states (a "mamba" group, as
vLLM names MambaSpec groups), and the router credits a prefix only up to a boundary whose
state is announced: the window rule with a window of one token (docs/hybrid-models.md,
"Routing")."""

from __future__ import annotations

import pytest
import redis

from gcache.router.match import match_l3_only
from gcache.serving.announce.wire import KIND_FULL, StoredRun, block_removed, block_stored
from gcache.serving.redis_layout import L3_FULL, L3_SWA, Keys, page_ids
from tests.router.test_router_l3_events import BS, Frames, in_redis, router, subscriber, toks, vh, view_l3

pytestmark = pytest.mark.process  # redis-server

KIND_STATE = "mamba"  # vLLM's KVCacheSpecKind.MAMBA (Mamba2 and gated-delta-net groups alike)
STATE_WINDOW = 1  # a state model's registration window: the state at the cut, nothing before


def pages(tokens: list[int], seed: int) -> dict:
    n = len(tokens) // BS
    return block_stored(StoredRun(0, KIND_FULL, None, BS, None, [vh(p, seed) for p in range(n)], tokens[: n * BS]))


def state_at(tokens: list[int], seed: int, page: int) -> dict:
    """The state after pages [0, page]: one block of the state group, named like its page."""
    run = StoredRun(
        1,
        KIND_STATE,
        None,
        BS,
        vh(page - 1, seed) if page else None,
        [vh(page, seed)],
        tokens[page * BS : (page + 1) * BS],
    )
    return block_stored(run)


def test_a_hybrid_prefix_is_credited_up_to_its_last_announced_state(redis_proc):
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    sub = subscriber(redis_proc)
    core = router(redis_proc)
    t = toks(6 * BS, seed=5)
    ids = page_ids(t, BS)
    f = Frames()
    # Pages 0-5 saved; states at the boundaries after pages 1 and 3 (blocks 2 and 4).
    sub.receive(f(pages(t, 5), state_at(t, 5, 1), state_at(t, 5, 3)))
    assert sub.flush()
    assert in_redis(r, k.l3_full) == set(ids)
    assert in_redis(r, k.l3_swa) == {ids[1], ids[3]}  # resumable only where a state is
    view = view_l3(core)
    assert view == {**dict.fromkeys(ids, L3_FULL), ids[1]: L3_FULL | L3_SWA, ids[3]: L3_FULL | L3_SWA}
    # A prompt over all six pages (and more): credit stops at the last state, not at page 6.
    prompt = page_ids(t + toks(BS, seed=6), BS)
    assert match_l3_only(prompt, 7, view, BS, STATE_WINDOW) == 4
    assert match_l3_only(prompt, 3, view, BS, STATE_WINDOW) == 2  # a shorter limit: the state at 2
    # The state at 4 withdrawn (evicted from the store): back to the state at 2.
    sub.receive(f(block_removed(1, [vh(3, 5)])))
    assert sub.flush()
    view = view_l3(core)
    assert match_l3_only(prompt, 7, view, BS, STATE_WINDOW) == 2
    # A missing page before every state: nothing.
    sub.receive(f(block_removed(0, [vh(0, 5)])))
    assert sub.flush()
    assert match_l3_only(prompt, 7, view_l3(core), BS, STATE_WINDOW) == 0
    sub.stop()
    core.close()


def test_without_states_a_hybrids_pages_alone_are_never_credited(redis_proc):
    sub = subscriber(redis_proc)
    core = router(redis_proc)
    t = toks(4 * BS, seed=7)
    f = Frames()
    # The engine announced its state group once (so the translator knows the model has one),
    # then only pages of another prompt: those pages are not resumable.
    sub.receive(f(state_at(t, 7, 0)))
    other = toks(4 * BS, seed=8)
    sub.receive(f(pages(other, 8)))
    assert sub.flush()
    assert match_l3_only(page_ids(other, BS), 4, view_l3(core), BS, STATE_WINDOW) == 0
    sub.stop()
    core.close()
