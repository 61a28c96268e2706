"""Epochs on the data path (docs/cluster.md): STALE_EPOCH refusals, the node's
map in PING, and the Server hooks the cluster agent uses (set_cluster_map,
wait_puts_admitted_before, keys_page, keys, remove_keys). The native Server
runs in-process, as the daemon runs it."""

from __future__ import annotations

import functools
import os
import threading
import time

import msgpack
import pytest

import gcache
from gcache import _native, errors
from gcache.cluster.cluster_map import ACTIVE, ClusterMap, NodeInfo
from gcache.cluster.placement import Placement
from gcache.server.rebalance import Rebalancer
from gcache.wire.protocol import FrameStatus, encode_keys_meta
from gcache.wire.worth import WORTH_VERSION
from tests.support import waiting
from tests.support.raw_protocol import (
    BAD_FRAME,
    EXISTS_BATCH,
    GET_BATCH,
    OK,
    PING,
    PUT_BATCH,
    REMOVE_BATCH,
    STALE_EPOCH,
    STORED,
    RawConnection,
    frame_bytes,
)

MAP = msgpack.packb({"epoch": 5, "nodes": [{"id": "a", "address": "127.0.0.1:1"}]}, use_bin_type=True)


def leases_released(node) -> None:
    """The GETs' leases are dropped once the server has sent their payloads: after the client
    read them, but maybe not yet when it asks (the send completes on the server's thread)."""
    waiting.wait_until(lambda: node.stats()["gauges"]["leases_active"] == 0, "the leases released", timeout_s=30)


def config(tmp_path, **extra) -> dict:
    return {
        "port": 0,
        "data_dir": str(tmp_path / "data"),
        "memory_bytes": 16 << 20,
        "disk_bytes": 64 << 20,
        "idle_timeout_s": 10,
        "stall_timeout_s": 5,
        **extra,
    }


@pytest.fixture
def node(tmp_path):
    """A started in-process node at epoch 5 with MAP; stopped at teardown."""
    server = _native.Server(config(tmp_path))
    server.set_cluster_map(5, MAP)
    server.start()
    yield server
    server.stop(1)


def counters(server) -> dict:
    return server.stats()["counters"]


def arena_free_bytes(server) -> int:
    return server.stats()["gauges"]["arena_free_bytes"]


def put_frame_with_epoch(items, epoch, request_id: int) -> bytes:
    meta = {
        "keys": [k for k, _ in items],
        "lens": [len(v) for _, v in items],
        "sums": [_native.xxh64(v) for _, v in items],
        "epoch": epoch,
    }
    return frame_bytes(PUT_BATCH, meta, b"".join(v for _, v in items), request_id)


def assert_stale(frame, request_id: int) -> None:
    assert frame.status == STALE_EPOCH and frame.request_id == request_id, frame
    assert frame.meta["kind"] == "stale_epoch" and frame.meta["epoch"] == 5
    assert frame.meta["map"] == MAP and "map" in frame.meta["error"]
    assert frame.payload == b""


# -- the server side ----------------------------------------------------------


def test_cluster_map_epoch_only_moves_forward(tmp_path):
    server = _native.Server(config(tmp_path, epoch=3))
    assert server.epoch == 3 and server.cluster_map == b""
    server.set_cluster_map(5, MAP)
    assert server.epoch == 5 and server.cluster_map == MAP
    with pytest.raises(ValueError, match="older than the node's 5"):
        server.set_cluster_map(4, b"older")
    assert server.epoch == 5 and server.cluster_map == MAP
    server.set_cluster_map(5, b"same epoch, new map")  # equal epoch replaces the map
    assert server.epoch == 5 and server.cluster_map == b"same epoch, new map"
    with pytest.raises(ValueError, match="exceeds"):
        server.set_cluster_map(6, b"x" * ((4 << 20) + 1))
    assert server.epoch == 5


def test_ping_answers_epoch_and_map_whatever_the_request_epoch(node):
    with RawConnection(node.port) as c:
        answer = c.ping()
        assert len(answer["instance"]) == 16  # random per server start (hex)
        assert answer == {
            "version": "0.1.0",
            "epoch": 5,
            "map": MAP,
            "instance": answer["instance"],
            "cks": [0, 1],
            "worth": WORTH_VERSION,
        }
        frame = c.request(PING, {"epoch": 1})
        assert frame.status == OK and frame.meta["map"] == MAP
    node.set_cluster_map(6, b"")
    with gcache.Client(f"127.0.0.1:{node.port}", epoch=1) as client:
        assert client.ping() == {
            "version": "0.1.0",
            "epoch": 6,
            "map": b"",
            "instance": answer["instance"],
            "cks": [0, 1],
            "worth": WORTH_VERSION,
        }


@pytest.mark.parametrize("opcode", [GET_BATCH, EXISTS_BATCH, REMOVE_BATCH])
def test_stale_read_and_remove_are_refused_and_do_nothing(node, opcode):
    with RawConnection(node.port) as c:
        assert c.put([(b"kept", b"value")]) == [STORED]
        hits_before = counters(node)["hits_memory"]
        c.send(frame_bytes(opcode, {"keys": [b"kept"], "epoch": 4}, request_id=77))
        assert_stale(c.recv_frame(), 77)
        assert c.get([b"kept"]) == [b"value"]  # same connection, still in sync; not removed
    assert counters(node)["hits_memory"] == hits_before + 1  # only the check above read it
    assert counters(node)["requests_stale_epoch"] == 1 and counters(node)["removes"] == 0


def test_stale_put_is_drained_and_leaks_no_reservation(node):
    free_before = arena_free_bytes(node)
    big = os.urandom(600 << 10)  # larger than the server's 256 KiB discard buffer
    with RawConnection(node.port) as c:
        # Three frames back to back: a stale PUT, then a current PUT and a GET.
        c.send(
            put_frame_with_epoch([(b"stale-a", big), (b"stale-b", b"v")], 4, request_id=1)
            + put_frame_with_epoch([(b"fresh", b"fresh value")], 5, request_id=2)
            + frame_bytes(GET_BATCH, {"keys": [b"stale-a", b"stale-b", b"fresh"]}, request_id=3)
        )
        assert_stale(c.recv_frame(), 1)
        stored = c.recv_frame()
        assert stored.status == OK and stored.request_id == 2 and stored.meta["st"] == [STORED]
        got = c.recv_frame()
        assert got.status == OK and got.request_id == 3
        assert got.meta["lens"] == [-1, -1, len(b"fresh value")] and got.payload == b"fresh value"
    assert sorted(node.keys(100)) == [b"fresh"]
    stats = node.stats()
    assert stats["counters"]["requests_stale_epoch"] == 1
    assert stats["counters"]["puts_stored"] == 1 and stats["counters"]["bytes_in"] == len(b"fresh value")
    leases_released(node)
    # Only "fresh" holds arena space: the refused 600 KiB was never reserved.
    assert free_before - stats["gauges"]["arena_free_bytes"] < 64 << 10
    node.check_integrity()


@pytest.mark.parametrize("epoch", [5, 6, None])
def test_current_newer_or_no_epoch_is_served(node, epoch):
    with gcache.Client(f"127.0.0.1:{node.port}", epoch=epoch) as client:
        assert client.put(b"k", b"v") is True
        assert client.get(b"k") == b"v" and client.is_exist(b"k") is True
        assert client.batch_remove([b"k", b"missing"]) == [True, False]
    assert counters(node)["requests_stale_epoch"] == 0


def test_epoch_that_is_not_an_integer_is_a_bad_frame(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(GET_BATCH, {"keys": [b"k"], "epoch": "5"}, request_id=9))
        frame = c.recv_frame()
        assert frame.status == BAD_FRAME and "epoch" in frame.meta["error"]
        assert c.get([b"k"]) == [None]  # metadata errors keep the connection


# -- the client side ----------------------------------------------------------


def test_client_raises_stale_epoch_error_and_keeps_its_connection(node):
    with gcache.Client(f"127.0.0.1:{node.port}", epoch=4, pool_size=1, transport="tcp") as client:
        for call in (
            lambda: client.put(b"k", b"v"),
            lambda: client.get(b"k"),
            lambda: client.batch_is_exist([b"k"]),
            lambda: client.remove(b"k"),
        ):
            with pytest.raises(errors.StaleEpochError) as info:
                call()
            assert info.value.epoch == 5 and info.value.map_bytes == MAP
            assert info.value.status == FrameStatus.STALE_EPOCH and info.value.kind == "stale_epoch"
            assert isinstance(info.value, errors.ServerError) and "newer cluster map" in str(info.value)
        assert node.keys(10) == []
        client.epoch = 5
        assert client.put(b"k", b"v") is True and client.get(b"k") == b"v"
        assert client._pool.open_count == 1
    c = counters(node)
    assert c["requests_stale_epoch"] == 4 and c["connections_accepted"] == 1  # never reconnected


def test_stale_epoch_mid_pipeline_drains_frames_in_flight(node):
    keys = [f"key-{i}".encode() for i in range(20)]
    values = [os.urandom(1000) for _ in keys]
    with gcache.Client(
        f"127.0.0.1:{node.port}", epoch=4, pool_size=1, batch_keys_max=2, transport="tcp", pipeline_depth=8
    ) as client:
        with pytest.raises(errors.StaleEpochError):
            client.put_batch(keys, values)  # 10 frames, several in flight when the first is refused
        with pytest.raises(errors.StaleEpochError):
            client.get_batch(keys)
        refused = counters(node)["requests_stale_epoch"]
        assert 2 < refused <= 20  # more than one frame per call was in flight, and read
        assert node.keys(100) == []
        client.epoch = 5
        assert client.put_batch(keys, values) == [True] * 20
        assert client.get_batch(keys) == values
    c = counters(node)
    assert c["connections_accepted"] == 1 and c["requests_stale_epoch"] == refused
    leases_released(node)
    node.check_integrity()


def test_client_epoch_is_validated_and_absent_epoch_sends_the_old_bytes():
    with pytest.raises(errors.InvalidArgumentError, match="epoch"):
        gcache.Client("127.0.0.1:1", epoch=-1)
    with pytest.raises(errors.InvalidArgumentError, match="epoch"):
        gcache.Client("127.0.0.1:1", epoch="3")
    client = gcache.Client("127.0.0.1:1")
    assert client.epoch is None
    client.epoch = 7
    assert client.epoch == 7
    for keys in ([b"k"], [b"x" * 300], [b"a", b"bb"]):
        assert encode_keys_meta(keys) == msgpack.packb({"keys": keys}, use_bin_type=True)
        for epoch in (0, 5, 300, 2**40):
            assert encode_keys_meta(keys, epoch) == msgpack.packb({"keys": keys, "epoch": epoch}, use_bin_type=True)


# -- keys() and remove_keys() ----------------------------------------------------


def test_keys_snapshot_memory_then_disk_after_restart(tmp_path):
    stored = {f"k{i:03d}".encode(): os.urandom(2000) for i in range(50)}
    server = _native.Server(config(tmp_path))
    server.start()
    with RawConnection(server.port) as c:
        assert c.put(list(stored.items())) == [STORED] * 50
        assert c.remove([b"k000"]) == [0]
    del stored[b"k000"]
    assert sorted(server.keys(1000)) == sorted(stored)
    some = server.keys(7)
    assert len(some) == 7 and set(some) <= set(stored)
    assert server.keys(0) == []
    with pytest.raises(ValueError):
        server.keys(-1)
    server.stop(1)
    server.flush()
    del server

    # Warm restart off: every value is only on disk now.
    server = _native.Server(config(tmp_path, warm_restart=False))
    gauges = server.stats()["gauges"]
    assert gauges["keys_memory"] == 0 and gauges["keys_disk"] == 49
    assert sorted(server.keys(1000)) == sorted(stored)
    assert server.remove_keys([b"k001", b"k002", b"missing", b"k001"]) == 2
    assert sorted(server.keys(1000)) == sorted(set(stored) - {b"k001", b"k002"})
    server.check_integrity()
    server.start()
    with RawConnection(server.port) as c:
        assert c.get([b"k001", b"k003"]) == [None, stored[b"k003"]]
    server.stop(1)


# -- wait_puts_admitted_before: PUTs admitted under an older map -------------------

WAIT_S = 5.0  # bounds every wait below; the server's stall timeout is 5 s too
wait_until = functools.partial(waiting.wait_until, timeout_s=WAIT_S, step_s=0.01)


def start_put(port: int, key: bytes, value: bytes, epoch, cut: int) -> RawConnection:
    """Sends a PUT frame for one key up to `cut` payload bytes: admitted, not finished."""
    meta = {"keys": [key], "lens": [len(value)], "sums": [_native.xxh64(value)]}
    if epoch is not None:
        meta["epoch"] = epoch
    conn = RawConnection(port, timeout_s=WAIT_S)
    conn.send(frame_bytes(PUT_BATCH, meta, value, request_id=41)[: -(len(value) - cut)])
    return conn


def admitted_below(server, epoch: int) -> bool:
    """True while some PUT admitted below `epoch` is still storing."""
    return not server.wait_puts_admitted_before(epoch, 0)


def test_put_admitted_under_the_old_epoch_holds_the_fence_until_stored(node):
    value = os.urandom(1 << 20)
    assert node.wait_puts_admitted_before(6, 0) is True  # nothing in flight
    with start_put(node.port, b"slow", value, 5, cut=len(value) // 2) as old:
        wait_until(lambda: admitted_below(node, 6), "the epoch-5 PUT to be admitted")
        node.set_cluster_map(6, MAP)
        assert node.wait_puts_admitted_before(6, 0.2) is False  # half its payload still to come
        assert node.wait_puts_admitted_before(5, 0) is True  # nothing admitted below 5
        old.send(value[len(value) // 2 :])
        assert node.wait_puts_admitted_before(6, WAIT_S) is True
        stored = old.recv_frame()
        assert stored.status == OK and stored.meta["st"] == [STORED]
    assert node.keys(10) == [b"slow"]
    with RawConnection(node.port) as c:
        assert c.get([b"slow"]) == [value]

    # Admitted at the new epoch 6 (with or without a request epoch): not waited for at 6, but at 7.
    for epoch in (6, None):
        with start_put(node.port, b"new-%s" % str(epoch).encode(), value, epoch, cut=1000) as new:
            wait_until(lambda: admitted_below(node, 7), "the epoch-6 PUT to be admitted")
            assert node.wait_puts_admitted_before(6, 0) is True
            assert node.wait_puts_admitted_before(7, 0.05) is False
            new.send(value[1000:])
            assert new.recv_frame().meta["st"] == [STORED]
        assert node.wait_puts_admitted_before(7, WAIT_S) is True
    node.check_integrity()


def test_put_frames_that_fail_release_the_fence(node):
    value = os.urandom(256 << 10)
    # A connection dropped mid-payload: its reservation and its count go.
    with start_put(node.port, b"dropped", value, 5, cut=1000):
        wait_until(lambda: admitted_below(node, 6), "the PUT to be admitted")
        node.set_cluster_map(6, MAP)
    assert node.wait_puts_admitted_before(6, WAIT_S) is True
    # An answered failure (bad checksum) and a refused stale PUT: neither holds it.
    with RawConnection(node.port) as c:
        assert c.put([(b"bad-sum", value)], sums=[1]) == [3]  # CHECKSUM_MISMATCH
        c.send(put_frame_with_epoch([(b"stale", value)], 5, request_id=9))
        assert c.recv_frame().status == STALE_EPOCH
        frame = c.request(PUT_BATCH, {"keys": [b"k"], "lens": [1, 2], "sums": [0]}, b"abc")
        assert frame.status == BAD_FRAME
    assert node.wait_puts_admitted_before(7, WAIT_S) is True
    assert node.keys(10) == []
    leases_released(node)
    node.check_integrity()
    with pytest.raises(ValueError, match="timeout_s"):
        node.wait_puts_admitted_before(6, -1)


def test_wait_releases_the_gil_and_wakes_when_the_put_finishes(node):
    value = os.urandom(1 << 20)
    with start_put(node.port, b"slow", value, 5, cut=10) as old:
        wait_until(lambda: admitted_below(node, 6), "the PUT to be admitted")
        node.set_cluster_map(6, MAP)
        # The rest is sent from another Python thread while this one waits in C++.
        sender = threading.Timer(0.2, old.send, args=(value[10:],))
        sender.start()
        started = time.monotonic()
        assert node.wait_puts_admitted_before(6, WAIT_S) is True
        assert time.monotonic() - started < WAIT_S
        sender.join(WAIT_S)
        assert old.recv_frame().meta["st"] == [STORED]


def test_rebalance_fence_sees_a_put_admitted_under_the_old_map(tmp_path):
    """The agent's order: set_cluster_map(6), then a rebalance (drop mode here) whose
    fence waits for the epoch-5 PUT still arriving: its key is listed, and dropped."""
    server = _native.Server(config(tmp_path))
    server.set_cluster_map(5, MAP)
    server.start()
    cmap = ClusterMap(
        6, (NodeInfo("a", f"127.0.0.1:{server.port}", 1, ACTIVE, 1), NodeInfo("b", "127.0.0.1:1", 1, ACTIVE, 1))
    )
    placement = Placement(cmap)
    keys = [f"k{i}".encode() for i in range(400)]
    slow = next(k for k in keys if placement.owner(k) == "b")
    rest = [k for k in keys if k != slow]
    value = os.urandom(300 << 10)
    rebalancer = Rebalancer(
        "a",
        f"127.0.0.1:{server.port}",
        list_keys_page=server.keys_page,
        remove_keys=server.remove_keys,
        fence=server.wait_puts_admitted_before,
        keys_page=37,
        keys_pending_max=50,
    )
    try:
        with RawConnection(server.port) as c:
            assert c.put([(k, b"v") for k in rest]) == [STORED] * len(rest)
        with start_put(server.port, slow, value, 5, cut=100) as old:
            wait_until(lambda: admitted_below(server, 6), "the PUT to be admitted")
            server.set_cluster_map(6, msgpack.packb(cmap.to_dict(), use_bin_type=True))
            threading.Timer(0.3, old.send, args=(value[100:],)).start()
            result = rebalancer.run(cmap, drop=True)
            assert old.recv_frame().meta["st"] == [STORED]
        owned_by_a = {k for k in keys if placement.owner(k) == "a"}
        assert set(server.keys(1000)) == owned_by_a
        assert result.keys_dropped == len(keys) - len(owned_by_a)
        assert result.keys_seen == len(keys)  # one pass: the fence did not time out
        server.check_integrity()
    finally:
        rebalancer.close()
        server.stop(1)


def test_rebalance_lists_again_when_the_fence_times_out(node):
    """A writer trickling a frame past fence_timeout_s: the scan runs anyway, then once more."""
    with RawConnection(node.port) as c:
        assert c.put([(f"k{i}".encode(), b"v") for i in range(100)]) == [STORED] * 100
    scans, fences = [], []

    def pages(cursor, limit):
        if cursor == 0:
            scans.append(time.monotonic())
        return node.keys_page(cursor, limit)

    def fence(epoch, timeout_s):
        fences.append((epoch, timeout_s))
        return False  # never drained

    cmap = ClusterMap(6, (NodeInfo("a", f"127.0.0.1:{node.port}", 1, ACTIVE, 1),))
    rebalancer = Rebalancer("a", f"127.0.0.1:{node.port}", list_keys_page=pages, fence=fence, fence_timeout_s=0.2)
    try:
        result = rebalancer.run(cmap)
    finally:
        rebalancer.close()
    assert len(scans) == 2 and result.keys_seen == 200 and result.keys_unowned == 0
    assert fences and all(epoch == 6 and 0 <= t <= 0.2 for epoch, t in fences)
    assert len(node.keys(1000)) == 100  # this node owns them all: nothing moved


# -- keys_page: a paged scan, the store lock held per page --------------------------


def put_empty_values(server, keys) -> None:
    """Empty values take no arena block, so tens of thousands of keys fit a small node. One
    batch of 70,000 puts is one reply: the native debug job (check_integrity after every store
    operation) takes longer than the default 5 s before it, hence the generous bound."""
    with gcache.Client(f"127.0.0.1:{server.port}", timeout_s=60.0) as client:
        assert all(client.put_batch(list(keys), [b""] * len(keys)))


def scan(server, limit: int, between_pages=lambda page_number: None) -> tuple[list, list]:
    """(every key listed, in order; every page's size), bounded in pages."""
    listed, sizes, cursor = [], [], 0
    for page_number in range(100_000):
        cursor, keys = server.keys_page(cursor, limit)
        assert isinstance(cursor, int) and cursor >= 0
        listed += keys
        sizes.append(len(keys))
        if cursor == 0:
            return listed, sizes
        between_pages(page_number)
    raise AssertionError("keys_page never returned cursor 0")


def test_keys_page_lists_every_key_exactly_once(node):
    keys = [f"key-{i:05d}".encode() for i in range(5000)]
    put_empty_values(node, keys)
    listed, sizes = scan(node, 333)
    assert len(listed) == len(keys) and set(listed) == set(keys)  # no duplicate, no miss
    assert all(0 <= n <= 333 for n in sizes) and len(sizes) >= len(keys) // 333
    cursor, everything = node.keys_page(0, 10**9)  # one page holds all 5000
    assert cursor == 0 and sorted(everything) == sorted(keys)
    assert sorted(node.keys(10**6)) == sorted(keys) and len(node.keys(17)) == 17


def test_keys_page_misses_no_key_that_stays_while_others_come_and_go(node):
    stay = [f"stay-{i:05d}".encode() for i in range(2000)]
    gone = [f"gone-{i:05d}".encode() for i in range(1000)]
    put_empty_values(node, stay + gone)
    added = []

    def churn(page_number):
        # The first 10 pages remove some keys and add many (the index triples: it rehashes).
        if page_number >= 10:
            return
        node.remove_keys(gone[page_number * 50 : (page_number + 1) * 50])
        fresh = [f"new-{page_number}-{i}".encode() for i in range(600)]
        put_empty_values(node, fresh)
        added.extend(fresh)

    listed, sizes = scan(node, 100, churn)
    assert set(stay) <= set(listed)  # present for the whole scan: listed at least once
    assert len(listed) > len(set(listed))  # the rehash restarted the scan: repeats, not misses
    assert set(listed) <= set(stay) | set(gone) | set(added)
    assert all(n <= 100 for n in sizes)
    node.check_integrity()


@pytest.mark.slow
def test_keys_page_limits_and_bad_cursors(node):
    keys = [f"k{i:05d}".encode() for i in range(70_000)]
    put_empty_values(node, keys)
    cursor, first = node.keys_page(0, 10**9)
    assert len(first) == 65536 and cursor != 0  # the cap: a page never copies more under the lock
    rest_cursor, rest = node.keys_page(cursor, 10**9)
    assert rest_cursor == 0 and set(first) | set(rest) == set(keys) and len(first) + len(rest) == 70_000
    for bad_limit in (0, -1):
        with pytest.raises(ValueError, match="limit"):
            node.keys_page(0, bad_limit)
    with pytest.raises(ValueError, match="cursor"):
        node.keys_page(-1, 10)
    # A cursor no page returned: ValueError; one from a table since rehashed: a restart.
    buckets, next_bucket = cursor >> 32, cursor & 0xFFFFFFFF
    assert 0 < next_bucket < buckets
    with pytest.raises(ValueError, match="cursor"):
        node.keys_page((buckets << 32) | buckets, 10)
    with pytest.raises(ValueError, match="cursor"):
        node.keys_page(5, 10)  # no bucket count
    assert node.keys_page(((buckets + 1) << 32) | 1, 500) == node.keys_page(0, 500)
