"""Workers publish, routers read, only through a real redis-server.

Real engines publish with WorkerPublisher (flushed synchronously); RouterCore instances read
with refresh(). Time that matters to the router (staleness, grace, backoff) runs on a
manual clock, so nothing here depends on how fast the box is.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis

from gcache.router.config import RouterConfig
from gcache.router.core import RouterCore
from gcache.serving.redis_layout import Keys
from gcache.worker.engine.request import SamplingParams
from gcache.worker.http.publisher import PublisherConfig, WorkerPublisher
from gcache.worker.model.transformer import Model
from tests.support.router_support import CFG, ManualClock, engine, history, run, tokens
from tests.support.waiting import wait_until

GREEDY_1 = SamplingParams(max_tokens=1, temperature=0.0)

URLS = ("http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003")


@pytest.fixture(scope="module")
def model():
    return Model(CFG)


def publisher(eng, rp, url, **kw) -> WorkerPublisher:
    cfg = PublisherConfig(rp.url, url, interval_s=0, ttl_s=kw.pop("ttl_s", 60.0), **kw)
    return WorkerPublisher(eng, cfg, start_thread=False)


def router(rp, clock=None, **kw) -> RouterCore:
    cfg = RouterConfig(redis_url=rp.url, refresh_interval_s=0, **kw)
    return RouterCore(cfg, clock=clock) if clock is not None else RouterCore(cfg)


def views(core: RouterCore) -> dict:
    with core.view.lock:
        return {u: (w.reg.epoch, w.reg.seq, dict(w.flags)) for u, w in core.view.workers.items()}


def test_late_router_rebuilds_the_same_view_and_two_routers_pick_alike(model, redis_proc):
    rng = np.random.default_rng(11)
    engs = [engine(model, full_pages=48, swa_pages=24) for _ in URLS]
    pubs = [publisher(e, redis_proc, u) for e, u in zip(engs, URLS)]
    early = router(redis_proc)
    convs = {u: [tokens(rng, 30) for _ in range(2)] for u in URLS}
    for turn in range(3):  # the early router follows every flush as stream deltas
        for e, p, u in zip(engs, pubs, URLS):
            reqs = run(e, convs[u], p)
            convs[u] = [history(r) + tokens(rng, 5) for r in reqs]
            assert p.flush()
        assert early.refresh()
    late = router(redis_proc)
    assert late.refresh()
    assert early.sync.stats["deltas"] > 0 and early.sync.stats["stream_gaps"] == 0
    assert late.sync.stats["deltas"] == 0  # it never read a delta: snapshot only
    assert views(early) == views(late)
    for e, p, u in zip(engs, pubs, URLS):  # and both equal what the workers hold
        assert p.events.rebuild() == 0
        assert views(late)[u][2] == p.events.mirror
    for policy in ("cache_aware", "dynamo", "least_load"):
        a, b = router(redis_proc, policy=policy), router(redis_proc, policy=policy)
        a.refresh(), b.refresh()
        for u in URLS:
            for conv in convs[u]:
                assert a.pick(conv) == b.pick(conv)
                if policy == "cache_aware":
                    assert a.pick(conv) == u  # its history lives there
    for p in pubs:
        p.stop()


def test_registration_expires_and_the_dead_worker_leaves_routing(model, redis_proc):
    clock = ManualClock()
    engs = [engine(model), engine(model)]
    live = publisher(engs[0], redis_proc, URLS[0])
    dying = publisher(engs[1], redis_proc, URLS[1], ttl_s=0.3)
    for p, e in zip((live, dying), engs):
        p.on_step(e)
        assert p.flush()
    core = router(redis_proc, clock=clock, worker_grace_s=2.0)
    assert core.refresh() and core.workers() == [URLS[0], URLS[1]]
    r = redis.Redis.from_url(redis_proc.url)
    wait_until(lambda: not r.exists(Keys().reg(URLS[1])))  # Redis expired the heartbeat
    assert live.flush() and core.refresh()
    assert core.workers() == [URLS[0]]  # missing registration: out of routing at once
    assert URLS[1] in core.view.workers  # its state is kept for the grace period...
    clock.advance(2.0)
    assert core.refresh()
    assert URLS[1] not in core.view.workers  # ...then dropped
    assert core.pick([5] * 40) == URLS[0]
    live.stop()  # deregisters: out of routing at once, not after the grace
    assert core.refresh() and core.workers() == [] and core.pick([5] * 40) is None
    clock.advance(2.0)
    assert core.refresh() and core.workers() == [] and not core.view.workers
    r.close()


def test_a_lone_worker_whose_heartbeat_lapsed_stays_routable_through_its_grace(model, redis_proc):
    """With no registered worker left, one whose heartbeat lapsed (a stalled publisher, or a
    Redis that lost the key) is still tried, by least load, until worker_grace_s."""
    clock = ManualClock()
    eng = engine(model)
    pub = publisher(eng, redis_proc, URLS[0], ttl_s=0.3)
    pub.on_step(eng)
    assert pub.flush()
    core = router(redis_proc, clock=clock, worker_grace_s=2.0)
    assert core.refresh() and core.workers() == [URLS[0]] and core.health()["redis"] == "up"
    r = redis.Redis.from_url(redis_proc.url)
    prompt = list(range(3, 50))
    for _ in range(2):
        wait_until(lambda: not r.exists(Keys().reg(URLS[0])))
        assert core.refresh() and core.workers() == [URLS[0]]
        h = core.health()
        assert h["redis"] == "resync" and h["workers"][0]["registered"] is False
        assert core.pick(prompt) == URLS[0] and core.explain(prompt)[URLS[0]]["mode"] == "fallback"
        clock.advance(1.0)
        assert pub.flush() and core.refresh()  # it publishes again: routed by cache
        assert core.health()["redis"] == "up" and core.explain(prompt)[URLS[0]]["mode"] == "cache"
    wait_until(lambda: not r.exists(Keys().reg(URLS[0])))
    assert core.refresh() and core.workers() == [URLS[0]]
    clock.advance(2.0)
    assert core.refresh() and core.workers() == [] and core.pick(prompt) is None
    r.close()
    pub.stop()


def test_window_safe_match_beats_raw_overlap_when_swa_pages_were_evicted(model, redis_proc):
    """Worker A holds every full page of a long prefix but lost the SWA window at its end;
    worker B holds a shorter prefix with its window. cache_aware sends the continuation to B
    (where it really hits); Dynamo's raw overlap (SWA-unaware) sends it to A."""
    rng = np.random.default_rng(5)
    base = tokens(rng, 96)  # 12 pages; W = 4 pages
    turn2 = base + tokens(rng, 40)
    probe = base + tokens(rng, 9)  # branches off at the end of `base`
    a, b = engine(model), engine(model)
    pa, pb = publisher(a, redis_proc, URLS[0]), publisher(b, redis_proc, URLS[1])
    run(a, [base], pa)
    run(a, [turn2], pa)  # `base`'s end is now an inner point of A's branch
    run(b, [base[:64]], pb)  # B: 8 pages, window-safe at its end
    # SWA pressure: the spare out-of-window pages go first, then the inner end of `base` loses its window.
    spare = a.tree.spare_pages()
    assert a.tree.evict(0, spare + 6) == (0, spare + 6)
    pa.on_step(a)
    assert pa.flush() and pb.flush()
    ca, dy = router(redis_proc), router(redis_proc, policy="dynamo")
    ca.refresh(), dy.refresh()
    seen = ca.explain(probe)
    assert seen[URLS[0]]["raw_overlap"] == 96 and seen[URLS[0]]["l1"] == 0
    assert seen[URLS[1]]["raw_overlap"] == 64 and seen[URLS[1]]["l1"] == 64
    assert ca.pick(probe) == URLS[1]
    assert dy.pick(probe) == URLS[0]
    # What each worker really serves for it: B hits more than A.
    ra, rb = run(a, [probe], pa)[0], run(b, [probe], pb)[0]
    assert (ra.cached_tokens, rb.cached_tokens) == (0, 64)
    pa.stop(), pb.stop()


def test_redis_killed_pick_falls_back_to_local_least_load_then_resyncs(model, redis_proc):
    clock = ManualClock()
    engs = [engine(model) for _ in URLS[:2]]
    pubs = [publisher(e, redis_proc, u) for e, u in zip(engs, URLS)]
    rng = np.random.default_rng(2)
    prompt = tokens(rng, 60)
    run(engs[0], [prompt], pubs[0])
    pubs[1].on_step(engs[1])
    for p in pubs:
        assert p.flush()
    core = router(redis_proc, clock=clock, redis_stale_s=1.0, recent_ttl_s=0)  # published state only
    assert core.refresh()
    assert core.pick(prompt) == URLS[0] and core.explain(prompt)[URLS[0]]["mode"] == "cache"
    before = views(core)
    redis_proc.kill9()
    assert not core.refresh() and not pubs[0].flush()  # both notice; neither raises
    assert core.pick(prompt) == URLS[0]  # within redis_stale_s the last view still routes
    clock.advance(1.01)
    core.begin(URLS[0])
    assert core.explain(prompt)[URLS[1]]["mode"] == "fallback"
    assert core.pick(prompt) == URLS[1]  # local least load: URLS[0] has one in flight
    core.end(URLS[0], ok=True)
    assert core.health()["redis"] == "down"
    redis_proc.start()  # back, and empty
    r = redis.Redis.from_url(redis_proc.url)
    assert r.dbsize() == 0
    assert pubs[1].flush() and pubs[1].counters["resyncs"] == 2  # its registration was gone: resync
    assert pubs[0].flush() and pubs[0].counters["resyncs"] == 2  # its last flush had failed: resync
    assert core.refresh() or core.refresh()  # the first call may meet its dead connection
    after = views(core)
    assert {u: v[2] for u, v in after.items()} == {u: v[2] for u, v in before.items()}
    assert all(after[u][0] != before[u][0] for u in after)  # new epochs: full reloads
    assert core.explain(prompt)[URLS[0]]["mode"] == "cache" and core.pick(prompt) == URLS[0]
    r.close()
    for p in pubs:
        p.stop()


def test_redis_restarted_empty_keeps_every_worker_routable_until_it_reregisters(model, redis_proc):
    """Redis comes back empty: until the publishers re-register (their retry pause), the
    router still routes to every worker it knew, by local least load (its cache view is
    from the old Redis); once all are back it routes by cache again. A worker that never
    re-registers leaves routing after worker_grace_s."""
    clock = ManualClock()
    engs = [engine(model) for _ in URLS[:2]]
    pubs = [publisher(e, redis_proc, u) for e, u in zip(engs, URLS)]
    rng = np.random.default_rng(6)
    prompt = tokens(rng, 60)
    run(engs[0], [prompt], pubs[0])
    pubs[1].on_step(engs[1])
    for p in pubs:
        assert p.flush()
    core = router(redis_proc, clock=clock, recent_ttl_s=0, worker_grace_s=2.0)
    assert core.refresh() and core.pick(prompt) == URLS[0]
    before = views(core)
    redis_proc.restart()  # -9 and back, empty, between two refreshes
    assert core.refresh() or core.refresh()  # the first call may meet its dead connection
    assert core.health()["redis"] == "resync"
    for step in range(3):  # nobody re-registered yet, then one did, then time passes
        assert core.workers() == list(URLS[:2])
        core.begin(URLS[0])
        seen = core.explain(prompt)
        assert {u: seen[u]["mode"] for u in URLS[:2]} == {URLS[0]: "fallback", URLS[1]: "fallback"}
        assert core.pick(prompt) == URLS[1]  # least load: URLS[0] has one in flight
        core.end(URLS[0], ok=True)
        assert core.pick(prompt) in URLS[:2]
        if step == 0:
            assert pubs[1].flush()  # re-registers (new epoch); URLS[0] has not yet
        clock.advance(0.9)
        assert core.refresh()
    assert pubs[0].flush() and core.refresh()
    assert core.health()["redis"] == "up"
    after = views(core)
    assert {u: v[2] for u, v in after.items()} == {u: v[2] for u, v in before.items()}
    assert core.explain(prompt)[URLS[0]]["mode"] == "cache" and core.pick(prompt) == URLS[0]
    # Again, but URLS[0] never comes back: routable through the grace, then dropped.
    redis_proc.restart()
    assert core.refresh() or core.refresh()
    assert pubs[1].flush() and core.refresh() and core.workers() == list(URLS[:2])
    clock.advance(2.0)
    assert core.refresh() and core.workers() == [URLS[1]] and core.health()["redis"] == "up"
    assert core.pick(prompt) == URLS[1] and core.explain(prompt)[URLS[1]]["mode"] == "cache"
    for p in pubs:
        p.stop()


def test_failed_worker_is_backed_off_then_probed_again():
    clock = ManualClock()
    core = RouterCore(RouterConfig(workers=URLS[:2], backoff_base_s=1.0, backoff_max_s=4.0), clock=clock)
    prompt = list(range(3, 60))
    first = core.pick(prompt)
    other = URLS[1] if first == URLS[0] else URLS[0]
    core.begin(first)
    core.end(first, ok=False)
    assert core.pick(prompt) == other
    assert core.pick(prompt, exclude=frozenset({other})) == first  # every candidate backed off: probe it
    clock.advance(1.0)
    assert core.pick(prompt) == first  # backoff over
    for _ in range(4):
        core.end(first, ok=False)  # doubling, capped at 4 s
    clock.advance(3.99)
    assert core.pick(prompt) == other
    clock.advance(0.01)
    assert core.pick(prompt) == first
    core.end(first, ok=True)
    assert core.health()["workers"][URLS.index(first)]["backoff_s"] == 0


def test_bad_input_and_malformed_redis_state(redis_proc):
    core = router(redis_proc)
    for bad in ([], [-1, 5], [2**32], ["a"], [[1, 2]]):
        with pytest.raises(ValueError):
            core.pick(bad)
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    r.zadd(k.workers, {URLS[0]: 1})
    r.set(k.reg(URLS[0]), b"{not json")
    assert core.refresh() and core.workers() == [] and core.sync.stats["bad_registrations"] == 1
    # A stream entry no publisher would write: the router reloads the snapshot, Redis stays "up".
    from gcache.serving.redis_layout import Registration, WorkerLoad

    good = Registration(URLS[0], "m", 8, 32, "ep", 0, 0, WorkerLoad())
    r.set(k.reg(URLS[0]), good.to_json())
    r.hset(k.pages(URLS[0]), mapping={(7).to_bytes(8, "big"): b"\x03"})
    r.xadd(k.events(URLS[0]), {"e": "ep", "s": 0, "r": 1})
    assert core.refresh() and core.workers() == [URLS[0]] and views(core)[URLS[0]][2] == {7: 3}
    r.xadd(k.events(URLS[0]), {"e": "ep", "s": 1, "d": b"12345"})  # not a multiple of 9 bytes
    r.set(k.reg(URLS[0]), Registration(URLS[0], "m", 8, 32, "ep", 1, 0, WorkerLoad()).to_json())
    assert core.refresh() and core.sync.stats["bad_entries"] == 1 and core.health()["redis"] == "up"
    assert core.pick(list(range(3, 40))) == URLS[0]
    # Garbage no publisher writes is skipped and counted; it never makes Redis look down.
    stats = dict(core.sync.stats)
    r.zadd(k.workers, {b"\xff\xfe": 1, "http://a b": 1, 'http://a"b': 1, "not-a-url": 1, URLS[1]: 1})
    r.zadd(k.l3_full, {b"12345678": "+inf", b"short": 5, (9).to_bytes(8, "big"): 7})
    r.set(k.reg(URLS[1]), b"[" * 100_000 + b"]" * 100_000)  # too deep for json: RecursionError
    assert core.refresh() and core.health()["redis"] == "up" and core.workers() == [URLS[0]]
    assert core.sync.stats["bad_worker_urls"] == stats["bad_worker_urls"] + 4
    assert core.sync.stats["bad_registrations"] == stats["bad_registrations"] + 1
    assert dict(core.view.l3) == {9: 1}
    r.set(k.reg(URLS[1]), b" " * (1 << 20) + good.to_json())  # valid JSON, but 1 MiB
    assert core.refresh() and core.sync.stats["bad_registrations"] == stats["bad_registrations"] + 2
    # A new epoch whose stream tail is garbage: the snapshot still loads (no delta can follow it).
    r.set(k.reg(URLS[0]), Registration(URLS[0], "m", 8, 32, "ep2", 0, 0, WorkerLoad()).to_json())
    r.xadd(k.events(URLS[0]), {"e": b"\xff", "s": b"zz"})
    assert core.refresh() and core.health()["redis"] == "up" and views(core)[URLS[0]] == ("ep2", 0, {7: 3})
    assert core.sync.stats["bad_entries"] == stats["bad_entries"] + 1
    with pytest.raises(ValueError):
        RouterConfig()  # neither Redis nor workers
    for bad_url in ("localhost:1", "http://a b", 'http://a"b', "http://x\n"):
        with pytest.raises(ValueError):
            RouterConfig(workers=(bad_url,))
    with pytest.raises(ValueError):
        RouterConfig(workers=URLS, policy="nope")
    r.close()


@pytest.mark.timeout(90)
def test_hung_redis_never_holds_up_pick(model, redis_proc):
    """Redis stopped (connections hang) under a running refresh thread with a 30 s timeout:
    pick() answers from the local view while refresh waits (were pick to wait for refresh,
    these picks would take 30 s each and the test would time out), then by local least load."""
    clock = ManualClock()
    eng = engine(model)
    pub = publisher(eng, redis_proc, URLS[0])
    pub.on_step(eng)
    assert pub.flush()
    core = RouterCore(
        RouterConfig(redis_url=redis_proc.url, refresh_interval_s=0.01, redis_timeout_s=30.0), clock=clock
    )
    core.start()
    wait_until(lambda: core.workers() == [URLS[0]])
    redis_proc.pause()
    try:
        wait_until(lambda: core._refreshing.locked())  # a refresh is (or soon will be) stuck on Redis
        for _ in range(5):
            assert core.pick(list(range(3, 50))) == URLS[0]
        clock.advance(1.5)
        assert core.explain(list(range(3, 50)))[URLS[0]]["mode"] == "fallback"
    finally:
        redis_proc.resume()
    core.close()
    pub.stop()


def test_a_router_behind_a_trimmed_stream_reloads_the_snapshot(model, redis_proc):
    """The stream keeps ~stream_max entries; a router whose last entry was trimmed away sees
    a seq gap and reloads the hash: its view ends equal to the worker's."""
    eng = engine(model, full_pages=40, swa_pages=24)
    pub = publisher(eng, redis_proc, URLS[0], stream_max=10)
    rng = np.random.default_rng(21)
    run(eng, [tokens(rng, 20)], pub)
    assert pub.flush()
    core = router(redis_proc)
    assert core.refresh()
    for _ in range(260):  # one small request per flush: > 2 stream nodes of 100 entries
        run(eng, [tokens(rng, 9)], pub, params=GREEDY_1)
        assert pub.flush()
    r = redis.Redis.from_url(redis_proc.url)
    assert r.xlen(Keys().events(URLS[0])) < 200  # trimmed (MAXLEN ~ trims whole nodes)
    assert core.refresh() and core.sync.stats["stream_gaps"] == 1
    assert core.refresh() and core.sync.stats["full_loads"] == 2
    assert pub.events.rebuild() == 0 and views(core)[URLS[0]][2] == pub.events.mirror
    r.close()
    pub.stop()
