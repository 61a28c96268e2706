"""gcache.ClusterClient against real gcache-server processes, routed by a map built here.

No master runs in these tests: every client starts from `initial_map`, and the
address names a master port nothing listens on (refreshes fail; the map stays).
"""

from __future__ import annotations

import functools
import os
import signal
import time

import msgpack
import numpy as np
import pytest

import gcache
from gcache import _native, errors
from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE, DRAINING, JOINING, ClusterMap, NodeInfo
from gcache.cluster.master_api import MasterUnavailableError
from gcache.cluster.placement import Placement
from gcache.common.processes import free_port
from tests.support import waiting
from tests.support.servers import ServerProcess

wait_until = functools.partial(waiting.wait_until, timeout_s=5.0, step_s=0.02)

pytestmark = pytest.mark.process  # starts processes

TIMEOUT_S = 0.5
RETRIES = 1
# A hang check, not a speed check: the most one call may take with a dead or stopped node.
CALL_BOUND_S = TIMEOUT_S * (RETRIES + 1) + 3.0


def no_master() -> str:
    return f"gcache://127.0.0.1:{free_port()}"


def make_map(epoch: int, nodes: list[tuple[str, str, str]]) -> ClusterMap:
    """nodes: (id, address, state)."""
    return ClusterMap.from_dict(
        {"epoch": epoch, "nodes": [NodeInfo(nid, address, 1, state).to_dict() for nid, address, state in nodes]}
    )


def cluster_client(cmap: ClusterMap, **kwargs) -> ClusterClient:
    kwargs.setdefault("timeout_s", TIMEOUT_S)
    kwargs.setdefault("retries", RETRIES)
    # The whole call's bound (default timeout_s * (retries + 1) = 1 s here) covers the
    # stale-epoch retry and new node clients too: a loaded machine needs more room.
    kwargs.setdefault("call_timeout_s", CALL_BOUND_S - 1.0)
    kwargs.setdefault("map_refresh_s", 0.2)
    kwargs.setdefault("master_timeout_s", 0.3)
    return ClusterClient(no_master(), initial_map=cmap, **kwargs)


def node_has(address: str, keys) -> list[bool]:
    with gcache.Client(address, timeout_s=5) as c:
        return c.batch_is_exist(keys)


def values_for(keys) -> list[bytes]:
    return [os.urandom(50 + (i * 37) % 3000) for i in range(len(keys))]


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """Three nodes shared by the tests that do not stop any; each test uses its own keys."""
    root = tmp_path_factory.mktemp("trio")
    servers = []
    try:
        for name in ("a", "b", "c"):
            servers.append(ServerProcess(root / name).start())
        yield {name: s.address for name, s in zip("abc", servers)}
    finally:
        for s in servers:
            s.kill()


@pytest.fixture
def trio_map(trio):
    return make_map(1, [(nid, addr, ACTIVE) for nid, addr in trio.items()])


def test_client_with_gcache_url_is_a_cluster_client(trio_map):
    with gcache.Client(no_master(), initial_map=trio_map, timeout_s=TIMEOUT_S) as client:
        assert isinstance(client, ClusterClient)
        assert client.cluster_map == trio_map
        assert "epoch=1" in repr(client) and "nodes=3" in repr(client)
        pings = client.ping()
        assert set(pings) == {"a", "b", "c"}
        assert all(isinstance(p, dict) and p["version"] for p in pings.values())
        assert set(client.stats()) == {"a", "b", "c"}
    assert isinstance(gcache.Client(trio_map.nodes[0].address), gcache.Client)
    with pytest.raises(errors.ClientClosedError):
        client.get(b"x")


def test_without_a_map_or_reachable_master_start_fails_clearly():
    with pytest.raises(MasterUnavailableError, match="initial_map"):
        ClusterClient(no_master(), master_timeout_s=0.3)
    with pytest.raises(errors.InvalidArgumentError):
        ClusterClient(None)
    with pytest.raises(errors.InvalidArgumentError):
        ClusterClient(no_master(), initial_map={"epoch": 1, "nodes": []})


def test_batch_round_trip_puts_each_value_only_on_its_owner(trio, trio_map):
    keys = [f"rt-{i}".encode() for i in range(300)]
    values = values_for(keys)
    owners = Placement(trio_map).write.owners(keys)
    assert set(owners) == {"a", "b", "c"}
    with cluster_client(trio_map) as client:
        assert client.put_batch(keys, values) == [True] * len(keys)
        assert client.get_batch(keys) == values
        assert client.get(keys[7]) == values[7]
        assert client.put(b"rt-single", b"one") is True
        assert client.get(b"rt-single") == b"one"
        stats = client.client_stats()
    for nid, address in trio.items():
        assert node_has(address, keys) == [o == nid for o in owners], f"node {nid}"
    assert stats["node_errors"] == 0 and stats["fallback_reads"] == 0


def test_zero_copy_methods_with_one_buffer_and_offsets(trio_map):
    n = 64
    keys = [f"zc-{i}".encode() for i in range(n)]
    sizes = [1 + (i * 4099) % 20000 for i in range(n)]
    offsets = [int(o) for o in np.cumsum([0] + sizes[:-1])]
    source = np.frombuffer(os.urandom(sum(sizes)), dtype=np.uint8).copy()
    target = np.zeros_like(source)
    with cluster_client(trio_map) as client:
        assert client.batch_put_from(keys, source, sizes=sizes, offsets=offsets) == [True] * n
        assert client.batch_get_into(keys, target, sizes=sizes, offsets=offsets) == sizes
        assert bytes(target) == bytes(source)
        # A list of buffers, one per key.
        outs = [bytearray(s) for s in sizes]
        assert client.batch_get_into(keys, outs) == sizes
        assert all(bytes(o) == bytes(source[off : off + s]) for o, off, s in zip(outs, offsets, sizes))
        # Single-key calls, by buffer and by address of a registered buffer.
        assert client.put_from(b"zc-one", source, offset=offsets[3], size=sizes[3]) is True
        out = bytearray(sizes[3] + 10)
        assert client.get_into(b"zc-one", out, 5, sizes[3] + 5) == sizes[3]
        assert bytes(out[5 : 5 + sizes[3]]) == bytes(source[offsets[3] : offsets[3] + sizes[3]])
        client.register_buffer(target)
        address = target.ctypes.data
        target[:] = 0
        assert client.get_into(b"zc-one", address + 100, sizes[3]) == sizes[3]
        assert bytes(target[100 : 100 + sizes[3]]) == bytes(out[5 : 5 + sizes[3]])
        assert client.unregister_buffer(target) == 0
        # A buffer too small for its value raises, after the other keys were read.
        small = [bytearray(s) for s in sizes]
        small[10] = bytearray(sizes[10] - 1) if sizes[10] > 1 else bytearray(0)
        with pytest.raises(errors.BufferTooSmallError) as info:
            client.batch_get_into(keys, small)
        assert info.value.keys == [keys[10]] and info.value.results[11] == sizes[11]
        assert info.value.results[10] is None


def test_exists_prefix_and_remove_across_owners(trio_map):
    keys = [f"ex-{i}".encode() for i in range(40)]
    owners = {Placement(trio_map).owner(k) for k in keys[:30]}
    assert len(owners) == 3  # the prefix crosses every node
    with cluster_client(trio_map) as client:
        stored = keys[:30] + keys[31:]
        assert client.put_batch(stored, [b"v"] * len(stored)) == [True] * len(stored)
        assert client.batch_exists_prefix(keys) == 30
        assert client.batch_is_exist(keys) == [k != keys[30] for k in keys]
        assert client.is_exist(keys[0]) and not client.is_exist(keys[30])
        assert client.batch_exists_prefix([]) == 0 and client.get_batch([]) == []
        assert client.batch_remove(keys[:5]) == [True] * 5
        assert client.remove(keys[0]) is False
        assert client.batch_exists_prefix(keys) == 0
        assert client.batch_exists_prefix(keys[5:]) == 25


def test_bad_arguments_raise_as_in_the_single_node_client(trio_map):
    with cluster_client(trio_map) as client:
        with pytest.raises(errors.KeyInvalidError):
            client.put(b"", b"v")
        with pytest.raises(errors.InvalidArgumentError):
            client.put_batch([b"a", b"b"], [b"v"])
        with pytest.raises(errors.InvalidArgumentError):
            client.put(b"k", "text")
        with pytest.raises(errors.InvalidArgumentError):
            client.batch_get_into([b"a"], bytearray(4))  # one buffer needs offsets and sizes


def test_empty_write_ring_misses_everything():
    with cluster_client(ClusterMap.empty()) as client:
        assert client.put_batch([b"a", b"b"], [b"1", b"2"]) == [False, False]
        assert client.get_batch([b"a"]) == [None] and client.batch_exists_prefix([b"a"]) == 0
        assert client.ping() == {}


def _split_by_owner(cmap: ClusterMap, prefix: str, n: int, victim: str):
    keys = [f"{prefix}-{i}".encode() for i in range(n)]
    placement = Placement(cmap)
    on_victim = [placement.owner(k) == victim for k in keys]
    assert any(on_victim) and not all(on_victim)
    return keys, on_victim


def test_a_killed_node_turns_its_keys_into_misses(server_factory):
    servers = {nid: server_factory(nid) for nid in ("a", "b", "c")}
    cmap = make_map(1, [(nid, s.address, ACTIVE) for nid, s in servers.items()])
    keys, on_b = _split_by_owner(cmap, "kill", 60, "b")
    values = values_for(keys)
    with cluster_client(cmap, suspect_s=30.0) as client:
        assert client.put_batch(keys, values) == [True] * len(keys)
        servers["b"].kill()
        started = time.monotonic()
        got = client.get_batch(keys)
        assert time.monotonic() - started < CALL_BOUND_S
        assert got == [None if b else v for b, v in zip(on_b, values)]
        assert client.client_stats()["node_errors"] >= 1
        # Suspect now: skipped without trying, for every kind of call.
        assert client.put_batch(keys, values) == [not b for b in on_b]
        assert client.batch_is_exist(keys) == [not b for b in on_b]
        assert client.batch_remove([k for k, b in zip(keys, on_b) if b]) == [False] * sum(on_b)
        assert client.client_stats()["suspect_skips"] >= 3 * sum(on_b)
        pings = client.ping()
        assert isinstance(pings["b"], str) and isinstance(pings["a"], dict)


def test_a_stopped_node_cannot_hang_a_call(server_factory):
    servers = {nid: server_factory(nid) for nid in ("a", "b", "c")}
    cmap = make_map(1, [(nid, s.address, ACTIVE) for nid, s in servers.items()])
    keys, on_c = _split_by_owner(cmap, "stop", 60, "c")
    values = values_for(keys)
    pid = servers["c"].proc.pid
    with cluster_client(cmap, suspect_s=0.2) as client:
        assert client.put_batch(keys, values) == [True] * len(keys)
        os.kill(pid, signal.SIGSTOP)  # TCP still accepts; nothing answers
        try:
            for call, expected in (
                (lambda: client.get_batch(keys), [None if c else v for c, v in zip(on_c, values)]),
                (lambda: client.put_batch(keys, values), [not c for c in on_c]),
                (
                    lambda: client.batch_get_into(keys, [bytearray(len(v)) for v in values]),
                    [None if c else len(v) for c, v in zip(on_c, values)],
                ),
                (lambda: client.batch_is_exist(keys), [not c for c in on_c]),
            ):
                time.sleep(0.3)  # past suspect_s: every call really waits on the stopped node
                started = time.monotonic()
                assert call() == expected
                assert time.monotonic() - started < CALL_BOUND_S
            assert client.client_stats()["node_errors"] >= 4
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.3)  # no longer suspect: the node answers again
        assert client.get_batch(keys) == values


def test_joining_node_reads_fall_back_to_previous_owners(trio):
    before = make_map(1, [("a", trio["a"], ACTIVE), ("b", trio["b"], ACTIVE)])
    joining = make_map(2, [("a", trio["a"], ACTIVE), ("b", trio["b"], ACTIVE), ("c", trio["c"], JOINING)])
    keys, moving = _split_by_owner(joining, "join", 120, "c")
    values = values_for(keys)
    with cluster_client(before) as old:
        assert old.put_batch(keys, values) == [True] * len(keys)
    assert node_has(trio["c"], keys) == [False] * len(keys)
    with cluster_client(joining) as client:
        assert client.get_batch(keys) == values
        stats = client.client_stats()
        assert stats["fallback_reads"] == sum(moving) == stats["fallback_hits"]
        outs = [bytearray(len(v)) for v in values]
        assert client.batch_get_into(keys, outs) == [len(v) for v in values]
        assert [bytes(o) for o in outs] == values
        assert client.batch_exists_prefix(keys) == len(keys)
        # New writes go to the joining node alone.
        fresh = [k + b"-new" for k, m in zip(keys, moving) if m][:10]
        fresh = [k for k in fresh if Placement(joining).owner(k) == "c"] or [b"join-new-c"]
        assert client.put_batch(fresh, [b"x"] * len(fresh)) == [True] * len(fresh)
        assert node_has(trio["c"], fresh) == [True] * len(fresh)
        # A remove reaches the previous owner too, so no fallback read resurrects the key.
        gone = [k for k, m in zip(keys, moving) if m][:5]
        assert client.batch_remove(gone) == [True] * len(gone)
        assert client.get_batch(gone) == [None] * len(gone)
    # Once the migration is over there is no fallback: unmoved keys are misses at c.
    settled = make_map(3, [(n.id, n.address, ACTIVE) for n in joining.nodes])
    with cluster_client(settled) as client:
        got = client.get_batch(keys)
        assert [g is None for g in got] == moving
        assert client.client_stats()["fallback_reads"] == 0


def test_draining_node_serves_reads_and_takes_no_writes(trio):
    with_c = make_map(1, [(nid, addr, ACTIVE) for nid, addr in trio.items()])
    draining = make_map(2, [("a", trio["a"], ACTIVE), ("b", trio["b"], ACTIVE), ("c", trio["c"], DRAINING)])
    keys, on_c = _split_by_owner(with_c, "drain", 120, "c")
    values = values_for(keys)
    with cluster_client(with_c) as old:
        assert old.put_batch(keys, values) == [True] * len(keys)
    with cluster_client(draining) as client:
        assert client.get_batch(keys) == values
        stats = client.client_stats()
        assert stats["fallback_hits"] == sum(on_c) and stats["fallback_reads"] >= sum(on_c)
        fresh = [f"drain-new-{i}".encode() for i in range(60)]
        assert client.put_batch(fresh, [b"x"] * len(fresh)) == [True] * len(fresh)
        assert node_has(trio["c"], fresh) == [False] * len(fresh)
    # The last node draining: no node takes writes, reads still reach it.
    only_c = make_map(3, [("c", trio["c"], DRAINING)])
    with cluster_client(only_c) as client:
        c_keys = [k for k, c in zip(keys, on_c) if c]
        assert client.get_batch(c_keys) == [v for v, c in zip(values, on_c) if c]
        assert client.put(b"drain-nowhere", b"x") is False


@pytest.fixture
def native_nodes(tmp_path):
    """Two in-process nodes whose cluster map the test sets (Server.set_cluster_map)."""
    if not hasattr(_native.Server, "set_cluster_map"):
        pytest.skip("the native module predates set_cluster_map: rebuild it")
    servers = []
    for name in ("x", "y"):
        server = _native.Server(
            {"port": 0, "data_dir": str(tmp_path / name), "memory_bytes": 16 << 20, "disk_bytes": 32 << 20}
        )
        server.start()
        servers.append(server)
    yield {name: s for name, s in zip("xy", servers)}
    for s in servers:
        s.stop(1)


def _publish(servers, cmap: ClusterMap, with_map: bool = True) -> None:
    blob = msgpack.packb(cmap.to_dict(), use_bin_type=True) if with_map else b""
    for s in servers:
        s.set_cluster_map(cmap.epoch, blob)


def test_stale_epoch_adopts_the_nodes_map_and_retries_by_new_owners(native_nodes):
    addr = {nid: f"127.0.0.1:{s.port}" for nid, s in native_nodes.items()}
    old = make_map(1, [("x", addr["x"], ACTIVE)])
    new = make_map(2, [("x", addr["x"], ACTIVE), ("y", addr["y"], ACTIVE)])
    _publish(native_nodes.values(), new)
    keys, on_y = _split_by_owner(new, "stale", 80, "y")
    values = values_for(keys)
    with cluster_client(old) as client:
        assert client.put_batch(keys, values) == [True] * len(keys)
        assert client.cluster_map == new
        assert client.client_stats()["stale_epoch_retries"] >= 1
        assert client.client_stats()["map_updates"] == 1
        assert client.get_batch(keys) == values
    assert node_has(addr["y"], keys) == on_y
    assert node_has(addr["x"], keys) == [not y for y in on_y]


def test_stale_epoch_without_a_map_anywhere_gives_bounded_misses(native_nodes):
    addr = f"127.0.0.1:{native_nodes['x'].port}"
    old = make_map(1, [("x", addr, ACTIVE)])
    _publish([native_nodes["x"]], make_map(5, [("x", addr, ACTIVE)]), with_map=False)
    with cluster_client(old) as client:
        started = time.monotonic()
        assert client.put_batch([b"s1", b"s2"], [b"1", b"2"]) == [False, False]
        assert client.get_batch([b"s1"]) == [None]
        assert time.monotonic() - started < 2 * CALL_BOUND_S
        assert client.cluster_map.epoch == 1  # nothing newer to adopt: masters are down


class FakeMaster:
    """A gcache.Master that only answers GetMap, from a map the test sets."""

    def __init__(self, cmap: ClusterMap):
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        from gcache.cluster import master_api as api

        self.map = cmap
        self.calls = 0

        def get_map(request, context):
            self.calls += 1
            newer = self.map.epoch > request.get("if_newer_than", -1)
            return {"map": self.map.to_dict() if newer else None}

        handler = grpc.method_handlers_generic_handler(
            api.SERVICE,
            {
                "GetMap": grpc.unary_unary_rpc_method_handler(
                    get_map, request_deserializer=api.unpack, response_serializer=api.pack
                )
            },
        )
        self.server = grpc.server(ThreadPoolExecutor(2), handlers=(handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def url(self) -> str:
        return f"gcache://127.0.0.1:{free_port()},127.0.0.1:{self.port}"  # the first is down

    def stop(self) -> None:
        self.server.stop(0).wait(5)


@pytest.fixture
def fake_master():
    masters = []

    def start(cmap: ClusterMap) -> FakeMaster:
        masters.append(FakeMaster(cmap))
        return masters[-1]

    yield start
    for m in masters:
        m.stop()


def test_map_comes_from_the_masters_and_stays_when_they_go(trio, fake_master):
    two = make_map(4, [("a", trio["a"], ACTIVE), ("b", trio["b"], ACTIVE)])
    three = make_map(5, [(nid, addr, ACTIVE) for nid, addr in trio.items()])
    master = fake_master(two)
    keys = [f"ms-{i}".encode() for i in range(60)]
    with ClusterClient(master.url, timeout_s=TIMEOUT_S, map_refresh_s=0.1, master_timeout_s=0.5) as client:
        assert client.cluster_map == two and client.client_stats()["map_refreshes"] >= 1
        assert client.put_batch(keys, [b"v"] * len(keys)) == [True] * len(keys)
        assert node_has(trio["c"], keys) == [False] * len(keys)
        master.map = three  # the background refresh picks it up
        assert wait_until(lambda: client.cluster_map == three)
        assert client.client_stats()["map_updates"] == 1
        fresh = [f"ms-new-{i}".encode() for i in range(60)]
        assert client.put_batch(fresh, [b"v"] * len(fresh)) == [True] * len(fresh)
        assert node_has(trio["c"], fresh) == [Placement(three).owner(k) == "c" for k in fresh]
        # An older map from a lagging master is never adopted.
        master.map = two
        time.sleep(0.3)
        assert client.cluster_map == three
        master.stop()
        time.sleep(0.3)
        assert client.cluster_map == three and client.get_batch(fresh) == [b"v"] * len(fresh)
        assert "epoch=5" in repr(client) and "nodes=3" in repr(client)


def test_a_failing_node_asks_for_a_refresh_at_once(trio, server_factory, fake_master):
    doomed = server_factory("doomed")
    with_doomed = make_map(1, [("a", trio["a"], ACTIVE), ("d", doomed.address, ACTIVE)])
    master = fake_master(with_doomed)
    keys, on_d = _split_by_owner(with_doomed, "refresh", 40, "d")
    with ClusterClient(master.url, timeout_s=TIMEOUT_S, map_refresh_s=600, master_timeout_s=0.5) as client:
        calls = master.calls
        doomed.kill()
        master.map = make_map(2, [("a", trio["a"], ACTIVE)])  # the master noticed too
        assert client.put_batch(keys, [b"v"] * len(keys)) == [not d for d in on_d]
        assert wait_until(lambda: client.cluster_map.epoch == 2)  # long before map_refresh_s
        assert master.calls > calls
        assert client.put_batch(keys, [b"v"] * len(keys)) == [True] * len(keys)
        assert client.get_batch(keys) == [b"v"] * len(keys)
        assert set(client.ping()) == {"a"}
        assert "d" not in client._nodes._clients  # its connections were closed with it


def test_threads_share_one_client_while_a_node_joins(trio, fake_master):
    """Every read returns exactly what its thread wrote, before, during and after the switch."""
    import threading

    two = make_map(1, [("a", trio["a"], ACTIVE), ("b", trio["b"], ACTIVE)])
    master = fake_master(two)
    failures: list = []
    stop = threading.Event()
    with ClusterClient(master.url, timeout_s=2.0, map_refresh_s=0.05, master_timeout_s=0.5) as client:

        def worker(t: int):
            try:
                for round_ in range(10_000):
                    if stop.is_set():
                        return
                    keys = [f"thr-{t}-{round_}-{i}".encode() for i in range(20)]
                    values = [os.urandom(100 + i) for i in range(20)]
                    assert client.put_batch(keys, values) == [True] * 20
                    assert client.get_batch(keys) == values
                    assert client.batch_exists_prefix(keys) == 20
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(4)]
        for th in threads:
            th.start()
        time.sleep(0.3)
        master.map = make_map(2, [("a", trio["a"], ACTIVE), ("b", trio["b"], ACTIVE), ("c", trio["c"], JOINING)])
        assert wait_until(lambda: client.cluster_map.epoch == 2)
        time.sleep(0.3)
        stop.set()
        for th in threads:
            th.join(10)
        assert not any(th.is_alive() for th in threads)
    assert not failures, failures[0]
