"""Every transport answers the same calls the same way: round trips, misses, bad
input, a server that dies and comes back. tcp and shm run here against real
servers; rdma runs where a device exists and skips with the reason elsewhere."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import gcache
from gcache import errors

KIB, MIB = 1024, 1024 * 1024
TRANSPORTS = ("tcp", "shm", "rdma")


@pytest.fixture
def node(server_factory):
    sock_dir = Path(tempfile.mkdtemp(prefix="gcp"))  # short: a socket path fits 107 bytes
    server = server_factory(extra_args=["--unix-socket", str(sock_dir / "s.sock"), "--value-bytes-max", "8MiB"])
    yield server
    server.kill()
    for p in sock_dir.iterdir():
        p.unlink()
    sock_dir.rmdir()


def open_client(node, transport: str, **kwargs):
    try:
        client = gcache.Client(node.address, transport=transport, **kwargs)
    except errors.TransportUnavailableError as exc:
        if transport == "rdma":
            pytest.skip(f"rdma unavailable here: {exc}")
        raise
    assert client.transport == transport
    return client


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_round_trips_misses_and_bad_input(node, transport):
    with open_client(node, transport) as c:
        sizes = [0, 1, 4 * KIB + 1, 300 * KIB, 8 * MIB]
        keys = [f"{transport}/{n}".encode() for n in sizes]
        values = [os.urandom(n) for n in sizes]
        assert c.put_batch(keys, values) == [True] * len(keys)
        assert c.get_batch(keys + [b"nope"]) == values + [None]
        assert c.get(keys[2]) == values[2] and c.get(b"nope") is None
        assert c.is_exist(keys[1]) and not c.is_exist(b"nope")
        assert c.batch_exists_prefix(keys + [b"nope"] + keys) == len(keys)
        one = bytearray(sum(sizes))
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        assert c.batch_get_into(keys, one, sizes=sizes, offsets=offsets) == sizes
        assert bytes(one) == b"".join(values)
        assert c.get_into(keys[3], bytearray(300 * KIB)) == 300 * KIB
        # Registered memory named by address (Mooncake's calling convention).
        import numpy as np

        arena = np.zeros(MIB, dtype=np.uint8)
        c.register_buffer(arena.ctypes.data, arena.nbytes)
        assert c.put_from(b"by-address", arena.ctypes.data + 10, 0, 100) is True  # size via offset slot
        assert c.get_into(b"by-address", arena.ctypes.data + 1000, 0, 100) == 100
        # Errors are the same exceptions, and change nothing else.
        with pytest.raises(errors.ValueTooLargeError) as info:
            c.put_batch([b"big", b"fine"], [bytes(8 * MIB + 1), b"f"])
        assert info.value.results == [False, True] and c.get(b"fine") == b"f"
        target = bytearray(b"\x11" * 10)
        with pytest.raises(errors.BufferTooSmallError):
            c.get_into(keys[2], target)
        assert target == bytearray(b"\x11" * 10)
        with pytest.raises(errors.KeyInvalidError):
            c.put(b"", b"x")
        with pytest.raises(errors.InvalidArgumentError):
            c.put(b"k", "text is not bytes")
        assert c.batch_remove([keys[1], b"nope"]) == [True, False]
        assert c.get(keys[1]) is None
        assert c.ping()["version"] and c.stats()["counters"]["puts_stored"] >= len(keys)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_server_is_an_error_and_a_restarted_one_is_used_again(node, transport):
    with open_client(node, transport, timeout_s=5, retries=2, retry_backoff_s=0.05) as c:
        assert c.put(b"before", b"1" * 5000)
        node.kill()
        with pytest.raises(errors.ConnectionError):
            c.get(b"before")
        node.start()  # same data dir and socket; memory values did not survive the kill
        assert c.get(b"before") is None
        assert c.put(b"after", b"2" * 5000) and c.get(b"after") == b"2" * 5000


def test_auto_falls_back_to_tcp_when_there_is_no_socket(server_factory):
    node = server_factory(extra_args=["--unix-socket", ""])
    with gcache.Client(node.address) as c:
        assert c.transport == "tcp" and c.put(b"k", b"v") and c.get(b"k") == b"v"
    with pytest.raises(errors.TransportUnavailableError, match="no Unix socket"):
        gcache.Client(node.address, transport="shm")


def test_transport_names_are_checked(monkeypatch):
    with pytest.raises(errors.InvalidArgumentError, match="transport"):
        gcache.Client("127.0.0.1:1", transport="carrier-pigeon")
    monkeypatch.setenv("GCACHE_TRANSPORT", "nope")
    with pytest.raises(errors.InvalidArgumentError, match="GCACHE_TRANSPORT"):
        gcache.Client("127.0.0.1:1")
    monkeypatch.setenv("GCACHE_TRANSPORT", "tcp")
    assert gcache.Client("127.0.0.1:1").transport == "tcp"


def test_one_declared_interface_for_a_server_and_a_cluster():
    from gcache.client import ClusterClient, ServerClient
    from gcache.cluster.cluster_map import ClusterMap

    server = gcache.Client("127.0.0.1:1", transport="tcp")
    assert type(server) is ServerClient and isinstance(server, gcache.Client)
    cmap = ClusterMap.from_dict(
        {"epoch": 1, "nodes": [{"id": "a", "address": "127.0.0.1:1", "weight": 1, "state": "active"}]}
    )
    cluster = gcache.Client(None, initial_map=cmap)
    try:
        assert type(cluster) is ClusterClient and isinstance(cluster, gcache.Client)
    finally:
        cluster.close()
    # Neither borrows the other's methods: every public method is declared once, on gcache.Client.
    for name in (
        "put",
        "put_batch",
        "put_from",
        "batch_put_from",
        "get_into",
        "batch_get_into",
        "register_buffer",
        "unregister_buffer",
        "is_exist",
        "remove",
    ):
        assert getattr(ServerClient, name) is getattr(gcache.Client, name)
        assert getattr(ClusterClient, name) is getattr(gcache.Client, name)


def test_the_cluster_client_picks_a_transport_per_node(server_factory):
    from gcache.client import ClusterClient
    from gcache.cluster.cluster_map import ClusterMap

    sock_dir = Path(tempfile.mkdtemp(prefix="gcn"))
    local = server_factory("local", extra_args=["--unix-socket", str(sock_dir / "a.sock")])
    no_socket = server_factory("plain", extra_args=["--unix-socket", ""])
    cmap = ClusterMap.from_dict(
        {
            "epoch": 1,
            "nodes": [
                {"id": "local", "address": local.address, "weight": 1, "state": "active"},
                {"id": "plain", "address": no_socket.address, "weight": 1, "state": "active"},
            ],
        }
    )
    keys = [b"spread-%d" % i for i in range(64)]
    values = [os.urandom(20 * KIB) for _ in keys]
    with ClusterClient(None, initial_map=cmap) as cluster:
        assert cluster.put_batch(keys, values) == [True] * len(keys)
        assert cluster.get_batch(keys) == values
        picked = {node.id: cluster._nodes.client(node).transport for node in cmap.nodes}
    assert picked == {"local": "shm", "plain": "tcp"}
    for server in (local, no_socket):  # both held some of the keys
        with gcache.Client(server.address, transport="tcp") as c:
            assert any(c.batch_is_exist(keys))
    (sock_dir / "a.sock").unlink(missing_ok=True)
    sock_dir.rmdir()
