"""Epochs on the data path (docs/cluster.md): STALE_EPOCH refusals, the node's
map in PING, and the Server hooks the cluster agent uses (set_cluster_map,
keys, remove_keys). The native Server runs in-process, as the daemon runs it."""
from __future__ import annotations

import os

import msgpack
import pytest

import gcache
from gcache import _native, errors
from gcache.protocol import FrameStatus, encode_keys_meta
from raw_protocol import (BAD_FRAME, EXISTS_BATCH, GET_BATCH, OK, PING, PUT_BATCH, REMOVE_BATCH, STORED,
                          RawConnection, frame_bytes)

STALE_EPOCH = 8
MAP = msgpack.packb({"epoch": 5, "nodes": [{"id": "a", "address": "127.0.0.1:1"}]}, use_bin_type=True)


def config(tmp_path, **extra) -> dict:
    return {"port": 0, "data_dir": str(tmp_path / "data"), "memory_bytes": 16 << 20,
            "disk_bytes": 64 << 20, "idle_timeout_s": 10, "stall_timeout_s": 5, **extra}


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
    meta = {"keys": [k for k, _ in items], "lens": [len(v) for _, v in items],
            "sums": [_native.xxh64(v) for _, v in items], "epoch": epoch}
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
        assert c.ping() == {"version": "0.1.0", "epoch": 5, "map": MAP}
        frame = c.request(PING, {"epoch": 1})
        assert frame.status == OK and frame.meta["map"] == MAP
    node.set_cluster_map(6, b"")
    with gcache.Client(f"127.0.0.1:{node.port}", epoch=1) as client:
        assert client.ping() == {"version": "0.1.0", "epoch": 6, "map": b""}


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
        c.send(put_frame_with_epoch([(b"stale-a", big), (b"stale-b", b"v")], 4, request_id=1)
               + put_frame_with_epoch([(b"fresh", b"fresh value")], 5, request_id=2)
               + frame_bytes(GET_BATCH, {"keys": [b"stale-a", b"stale-b", b"fresh"]}, request_id=3))
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
    assert stats["gauges"]["leases_active"] == 0
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
    with gcache.Client(f"127.0.0.1:{node.port}", epoch=4, pool_size=1) as client:
        for call in (lambda: client.put(b"k", b"v"), lambda: client.get(b"k"),
                     lambda: client.batch_is_exist([b"k"]), lambda: client.remove(b"k")):
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
    with gcache.Client(f"127.0.0.1:{node.port}", epoch=4, pool_size=1, batch_keys_max=2,
                       pipeline_depth=8) as client:
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
    assert node.stats()["gauges"]["leases_active"] == 0
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
        for epoch in (0, 5, 300, 2 ** 40):
            assert encode_keys_meta(keys, epoch) == msgpack.packb({"keys": keys, "epoch": epoch},
                                                                 use_bin_type=True)


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
