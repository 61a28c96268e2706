"""GCache's L3 events into the routers' shared L3 view (gcache.router.ingest.l3_events): a real
redis-server, and for the wire a real ZMQ PUB (the connector's own publisher) and the
subscriber's real SUB socket.

What a connector announces reaches Redis under the router's page ids and a router's view;
what it withdraws leaves both (unless another connector still announces it); hostile frames
are dropped and counted; Redis restarted empty gets the whole view again."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import redis

from gcache.common.processes import free_port
from gcache.router.config import RouterConfig
from gcache.router.core import RouterCore
from gcache.router.ingest.kv_events import ORPHAN_WAIT_S
from gcache.router.ingest.l3_events import L3EventsConfig, L3Subscriber
from gcache.serving.announce.wire import KIND_FULL, StoredRun, block_removed, block_stored, event_batch
from gcache.serving.redis_layout import L3_FULL, L3_SWA, Keys, id_bytes, page_ids
from tests.support.router_support import ManualClock
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process  # redis-server

BS = 16
BOTH = L3_FULL | L3_SWA


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 30_000) for _ in range(n)]


def vh(i: int, seed: int = 0) -> int:
    return (0x9E3779B97F4A7C15 * (i + 1) + seed * 7919) % (1 << 64)


def stored(tokens: list[int], seed: int = 0, first: int = 0) -> dict:
    n = len(tokens) // BS
    run = StoredRun(
        0,
        KIND_FULL,
        None,
        BS,
        vh(first - 1, seed) if first else None,
        [vh(p, seed) for p in range(first, n)],
        tokens[first * BS : n * BS],
    )
    return block_stored(run)


class Frames:
    """One connector's messages: (topic, sequence, batch)."""

    def __init__(self, topic: bytes = b"kv@a@m") -> None:
        self.topic, self.seq = topic, 0

    def __call__(self, *events: dict) -> list[bytes]:
        self.seq += 1
        return [self.topic, (self.seq - 1).to_bytes(8, "big"), event_batch(1.0, list(events))]


def subscriber(rp, n: int = 1, endpoints=None, clock=time.monotonic, **kw) -> L3Subscriber:
    cfg = L3EventsConfig(
        endpoints=endpoints or tuple(f"tcp://127.0.0.1:{free_port()}" for _ in range(n)),
        redis_url=rp.url,
        page_size=BS,
        **kw,
    )
    return L3Subscriber(cfg, clock=clock, start_threads=endpoints is not None)


def in_redis(r, key: str) -> set[int]:
    return {int.from_bytes(m, "big") for m in r.zrange(key, 0, -1)}


def router(rp) -> RouterCore:
    return RouterCore(RouterConfig(redis_url=rp.url, refresh_interval_s=0, page_size=BS))


def view_l3(core: RouterCore) -> dict[int, int]:
    assert core.refresh()
    with core.view.lock:
        return dict(core.view.l3)


def test_announced_pages_reach_redis_and_the_router_and_withdrawn_ones_leave(redis_proc):
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    sub = subscriber(redis_proc)
    core = router(redis_proc)
    assert view_l3(core) == {}
    t = toks(4 * BS, seed=1)
    ids = page_ids(t, BS)
    f = Frames()
    sub.receive(f(stored(t[: 2 * BS], seed=1)))
    sub.receive(f(stored(t, seed=1, first=2)))
    assert sub.flush()
    assert in_redis(r, k.l3_full) == in_redis(r, k.l3_swa) == set(ids)
    assert view_l3(core) == dict.fromkeys(ids, BOTH)
    # Withdrawn: out of Redis, into the :gone sets, out of the router's view (it reads increments).
    sub.receive(f(block_removed(0, [vh(3, 1)])))
    assert sub.flush()
    assert in_redis(r, k.l3_full) == set(ids[:3]) and in_redis(r, k.l3_full_gone) == {ids[3]}
    assert view_l3(core) == dict.fromkeys(ids[:3], BOTH)
    assert core.sync.stats["l3_removed"] == 1
    # Stored again: back in, off the :gone set; a late router reads the same view.
    sub.receive(f(stored(t, seed=1, first=3)))
    assert sub.flush()
    assert in_redis(r, k.l3_full_gone) == set()
    assert view_l3(core) == view_l3(router(redis_proc)) == dict.fromkeys(ids, BOTH)
    # A block size other than the router's page size names no page the router computes.
    other = StoredRun(0, KIND_FULL, None, 2 * BS, None, [vh(0, 7)], toks(2 * BS, seed=7))
    sub.receive(f(block_stored(other)))
    assert sub.flush() and sub.stats()["events_other_block_size"] == 1
    assert view_l3(core) == dict.fromkeys(ids, BOTH)
    sub.stop()
    core.close()


def test_a_page_two_connectors_announce_leaves_only_when_both_withdraw_it(redis_proc):
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    sub = subscriber(redis_proc, n=2)
    t = toks(2 * BS, seed=2)
    ids = page_ids(t, BS)
    a, b = Frames(b"kv@a@m"), Frames(b"kv@b@m")
    sub.receive(a(stored(t, seed=2)), source=0)
    sub.receive(b(stored(t, seed=2)), source=1)
    assert sub.flush() and in_redis(r, k.l3_full) == set(ids)
    sub.receive(a(block_removed(0, [vh(1, 2)])), source=0)
    assert sub.flush() and in_redis(r, k.l3_full) == set(ids)  # b still vouches for it
    sub.receive(b(block_removed(0, [vh(1, 2)])), source=1)
    assert sub.flush() and in_redis(r, k.l3_full) == {ids[0]}
    # A sequence gap on a: what it announced may have been withdrawn meanwhile: its part goes.
    sub.receive(a(stored(t, seed=2)), source=0)
    assert sub.flush() and in_redis(r, k.l3_full) == set(ids)
    a.seq += 5
    sub.receive(a(block_removed(0, [])), source=0)
    assert sub.flush() and in_redis(r, k.l3_full) == {ids[0]}  # b's page 0 stays
    assert sub.stats()["events_gaps"] == 1
    sub.stop()


def test_a_page_stored_on_a_prefix_another_connector_announced_is_named_not_orphaned(redis_proc):
    """The L3 is one namespace: engine B loaded pages 0-1 from it (A announced them) and
    stored pages 2-3 on them; B's run names page 1 as its parent, which B never announced.
    Every connector's translation shares one chain, so B's pages are named (vLLM's block
    hashes agree across engines), in either arrival order (the two streams are independent
    sockets: a store whose parent is not named yet waits for ORPHAN_WAIT_S)."""
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    clock = ManualClock()
    sub = subscriber(redis_proc, n=2, clock=clock)
    core = router(redis_proc)
    t = toks(4 * BS, seed=4)
    ids = page_ids(t, BS)
    a, b = Frames(b"kv@host@m"), Frames(b"kv@host@m")  # same host and model: the same topic
    sub.receive(a(stored(t[: 2 * BS], seed=4)), source=0)
    sub.receive(b(stored(t, seed=4, first=2)), source=1)
    assert sub.flush()
    assert in_redis(r, k.l3_full) == in_redis(r, k.l3_swa) == set(ids)
    assert view_l3(core) == dict.fromkeys(ids, BOTH)
    stats = sub.stats()
    assert stats["events_orphans"] == 0 and stats["events_stored_blocks"] == 4 and stats["parked"] == 0, stats
    # A withdraws its pages: B never announced 0-1, so they leave; B's 2-3 stay (B vouches).
    sub.receive(a(block_removed(0, [vh(0, 4), vh(1, 4)])), source=0)
    assert sub.flush() and in_redis(r, k.l3_full) == set(ids[2:])
    sub.stop()
    core.close()


def test_a_store_that_arrives_before_its_parents_announcement_waits_for_it(redis_proc):
    """B's store comes first (parked, not credited), A's announcement of its parent next: all
    four pages are named. A page B withdrew while waiting is not held. A parent nobody names
    within ORPHAN_WAIT_S: the store is an orphan (counted, never credited)."""
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    clock = ManualClock()
    sub = subscriber(redis_proc, n=2, clock=clock)
    t = toks(5 * BS, seed=6)
    ids = page_ids(t, BS)
    a, b = Frames(b"kv@a@m"), Frames(b"kv@b@m")
    sub.receive(b(stored(t, seed=6, first=2)), source=1)  # pages 2-4, parent page 1
    sub.receive(b(block_removed(0, [vh(4, 6)])), source=1)  # B withdraws page 4 meanwhile
    assert sub.flush() and in_redis(r, k.l3_full) == set() and sub.stats()["parked"] == 1
    clock.advance(1.0)
    sub.receive(a(stored(t[: 2 * BS], seed=6)), source=0)  # pages 0-1
    assert sub.flush() and in_redis(r, k.l3_full) == set(ids[:4])
    stats = sub.stats()
    assert stats["parked"] == 0 and stats["events_orphans"] == 0 and stats["events_stored_blocks"] == 4, stats
    # Nobody names this one's parent: it waits, then counts as orphans (never credited).
    sub.receive(b(stored(toks(4 * BS, seed=5), seed=5, first=2)), source=1)
    assert sub.flush() and sub.stats()["parked"] == 1 and sub.stats()["events_orphans"] == 0
    clock.advance(ORPHAN_WAIT_S + 0.1)
    assert sub.flush() and sub.stats()["parked"] == 0 and sub.stats()["events_orphans"] == 2
    assert in_redis(r, k.l3_full) == set(ids[:4])
    # A sequence gap on B drops its parked stores with the rest of its part.
    sub.receive(b(stored(toks(4 * BS, seed=8), seed=8, first=2)), source=1)
    b.seq += 3
    sub.receive(b(block_removed(0, [])), source=1)
    assert sub.flush() and sub.stats()["parked"] == 0 and sub.stats()["events_gaps"] == 1
    sub.stop()


def test_hostile_frames_are_dropped_and_counted_and_good_ones_still_count(redis_proc):
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    sub = subscriber(redis_proc)
    f = Frames()
    hostile = [
        [b"kv"],  # one frame
        [b"kv", b"\x00" * 7, b""],  # a short sequence number
        [b"kv", (-1).to_bytes(8, "big", signed=True), b""],  # vLLM's replay end marker
        [f.topic, (0).to_bytes(8, "big"), b"\xc1\xc1 not msgpack"],
    ]
    f.seq = 1
    for frames in hostile:
        sub.receive(frames)
    t = toks(2 * BS, seed=3)
    ev = stored(t, seed=3)
    bad_events = [
        {**ev, "token_ids": ev["token_ids"][:-1]},  # tokens not whole blocks
        {**ev, "block_hashes": "nope"},
        {**ev, "block_hashes": [-1, 2]},
        {**ev, "token_ids": [1 << 40] * (2 * BS)},  # not a u32 token
        {**ev, "block_size": 0},
        {**ev, "type": "Nope"},
        {**ev, "block_hashes": [1] * (1 << 15)},  # past hashes_per_event_max
        [1, 2, 3],
        "BlockStored",
    ]
    sub.receive(f(*bad_events))
    sub.receive([f.topic, f.seq.to_bytes(8, "big"), msgpack.packb({"ts": 1, "events": 5})])
    f.seq += 1
    sub.receive([f.topic, f.seq.to_bytes(8, "big"), msgpack.packb([1.0] * 10)])
    f.seq += 1
    # Another medium (an engine's own GPU blocks): not the L3.
    sub.receive(f({**ev, "medium": "GPU", "locality": "LOCAL"}))
    assert sub.flush() and r.zcard(k.l3_full) == 0
    st = sub.stats()
    assert st["events_bad_frames"] == 3 and st["events_bad_batches"] == 3
    assert st["events_malformed"] == len(bad_events) and st["events_ignored_media"] == 1
    sub.receive(f(ev))
    assert sub.flush() and in_redis(r, k.l3_full) == set(page_ids(t, BS))
    sub.stop()


def test_redis_restarted_empty_gets_the_whole_view_again(redis_proc):
    k = Keys()
    sub = subscriber(redis_proc, redis_timeout_s=0.5)
    t = toks(3 * BS, seed=4)
    f = Frames()
    sub.receive(f(stored(t, seed=4)))
    assert sub.flush()
    redis_proc.kill9()
    sub.receive(f(block_removed(0, [vh(2, 4)])))
    assert not sub.flush()
    redis_proc.start()
    r = redis.Redis.from_url(redis_proc.url)
    assert r.zcard(k.l3_full) == 0
    wait_until(sub.flush, "a flush once Redis is back")
    assert in_redis(r, k.l3_full) == set(page_ids(t, BS)[:2]) and sub.counters["rewrites"] >= 1
    sub.stop()


def test_over_real_zmq_from_the_connectors_publisher(redis_proc):
    from gcache.integrations.vllm.events.publisher import EventPublisher, ZmqSink

    port = free_port()
    pub = EventPublisher("kv@pod@m", lambda: ZmqSink(f"tcp://*:{port}"))
    sub = subscriber(redis_proc, endpoints=(f"tcp://127.0.0.1:{port}",), interval_s=0.05)
    r = redis.Redis.from_url(redis_proc.url)
    k = Keys()
    t = toks(3 * BS, seed=5)
    ids = page_ids(t, BS)

    def announced():
        # PUB/SUB: a subscriber that is still connecting misses messages; announcing again is
        # what the connector does too (each save), and the router's chain makes it idempotent.
        pub.publish([stored(t, seed=5)])
        return in_redis(r, k.l3_full) == set(ids)

    wait_until(announced, "the announced pages in Redis")
    assert r.zscore(k.l3_swa, id_bytes(ids[0])) is not None
    pub.publish([block_removed(0, [vh(2, 5)])])
    wait_until(lambda: in_redis(r, k.l3_full) == set(ids[:2]), "the withdrawn page out of Redis")
    # Garbage on the wire does not stop the subscriber.
    import zmq

    raw = zmq.Context.instance().socket(zmq.PUB)
    raw_port = free_port()
    raw.bind(f"tcp://127.0.0.1:{raw_port}")
    sub2 = subscriber(redis_proc, endpoints=(f"tcp://127.0.0.1:{raw_port}",), interval_s=0.05)

    def junk_counted():
        raw.send_multipart([b"kv", b"x"])
        raw.send_multipart([b"kv", (0).to_bytes(8, "big"), b"\xff" * 64])
        return sub2.stats()["events_bad_frames"] >= 1 and sub2.stats()["events_bad_batches"] >= 1

    wait_until(junk_counted, "junk counted")
    assert sub2._threads[0].is_alive() and in_redis(r, k.l3_full) == set(ids[:2])
    raw.close(0)
    sub2.stop()
    sub.stop()
    pub.close()


def test_vllm_l3_servers_are_registered_as_loading_the_shared_l3_and_vllm_ones_are_not(redis_proc):
    from gcache.router.main import parse_args, start_translators

    plain, with_l3 = (f"http://127.0.0.1:{free_port()}@tcp://127.0.0.1:{free_port()}" for _ in range(2))
    args = parse_args(["--redis", redis_proc.url, "--vllm", plain, "--vllm-l3", with_l3])
    translators = start_translators(args, RouterConfig.from_args(args))
    try:
        got = {t.config.engine_url: t.config.l3 for t in translators}
        assert got == {plain.rpartition("@")[0]: False, with_l3.rpartition("@")[0]: True}
        assert all(t.info().l3 == t.config.l3 for t in translators)  # what the registration carries
    finally:
        for t in translators:
            t.stop()


def test_block_size_flag_sets_the_translators_and_the_l3_subscribers_page_size(redis_proc, tmp_path):
    """gcache-router --block-size: what a --vllm translator registers before the engine's first
    event, and the only block size --l3-events counts; without it, --page-size and the first
    event's."""
    from gcache.router.main import parse_args, start_l3_events, start_translators

    spec = f"http://127.0.0.1:{free_port()}@ipc://{tmp_path}/vllm.kv"
    for flags, translator_bs, l3_bs in (
        (["--block-size", "32"], 32, 32),
        (["--page-size", "8"], 8, None),
    ):
        args = parse_args(["--redis", redis_proc.url, "--vllm", spec, "--l3-events", f"ipc://{tmp_path}/l3.kv", *flags])
        config = RouterConfig.from_args(args)
        bridges = start_translators(args, config) + start_l3_events(args, config)
        try:
            assert [b.config.block_size for b in bridges[:1]] == [translator_bs]
            assert bridges[1].config.page_size == l3_bs
        finally:
            for b in bridges:
                b.stop()
    args = parse_args(["--redis", redis_proc.url, "--vllm", spec, "--block-size", "0"])
    with pytest.raises(ValueError, match="--block-size"):
        start_translators(args, RouterConfig.from_args(args))


def test_the_routers_metrics_show_the_l3_subscribers_counters(redis_proc):
    sub = subscriber(redis_proc)
    core = router(redis_proc)
    core.bridges = [sub]
    t = toks(3 * BS, seed=2)
    f = Frames()
    sub.receive(f(stored(t, seed=2)))
    sub.receive([b"kv@a@m", b"short"])  # a message of two frames, not three: counted, not applied
    assert sub.flush()
    label = f'source="{sub.source}"'
    lines = set(core.metrics_text().splitlines())
    assert f"gcache_router_l3_events_added{{{label}}} 3" in lines
    assert f"gcache_router_l3_events_pages{{{label}}} 3" in lines
    assert f"gcache_router_l3_events_events_bad_frames{{{label}}} 1" in lines
    assert f"gcache_router_l3_events_events_stored_blocks{{{label}}} 3" in lines
    sub.stop()
    core.close()
