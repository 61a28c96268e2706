"""The ClusterClient's one bound per call, and its transport per node (issue 21,
finding 9), against a real gcache-server and a node that never answers."""

from __future__ import annotations

import socket
import time

import pytest

from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE, ClusterMap, NodeInfo
from gcache.common.processes import free_port
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.process


def no_master() -> str:
    return f"gcache://127.0.0.1:{free_port()}"


def test_a_batch_with_a_hung_node_returns_its_misses_by_the_call_bound(tmp_path):
    server = ServerProcess(tmp_path / "n1").start()
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    cmap = ClusterMap(
        2, (NodeInfo("n1", server.address, 1, ACTIVE), NodeInfo("n2", "{}:{}".format(*hung.getsockname()), 1, ACTIVE))
    )
    bound_s = 0.8
    client = ClusterClient(no_master(), initial_map=cmap, transport="tcp", timeout_s=5.0, call_timeout_s=bound_s)
    try:
        keys = [b"key-%d" % i for i in range(64)]
        owners = client._routing.placement.write.owners(keys)
        assert {"n1", "n2"} <= set(owners)
        started = time.monotonic()
        stored = client.put_batch(keys, [k * 10 for k in keys])
        elapsed = time.monotonic() - started
        assert elapsed < 3 * bound_s, f"{elapsed:.2f}s for a call bounded by {bound_s}s"
        assert stored == [o == "n1" for o in owners]  # the hung node's keys: not stored
        got = client.get_batch(keys)
        assert got == [k * 10 if o == "n1" else None for k, o in zip(keys, owners)]
        assert client.node_transports(connect=False) == {"n1": "tcp", "n2": "tcp"}
    finally:
        client.close()
        hung.close()
        server.stop()


def test_the_cluster_client_reports_each_nodes_transport(tmp_path):
    server = ServerProcess(tmp_path / "n1").start()
    cmap = ClusterMap(1, (NodeInfo("n1", server.address, 1, ACTIVE),))
    try:
        with ClusterClient(no_master(), initial_map=cmap) as auto:
            assert auto.transport is None  # no node used yet
            assert auto.node_transports() == {"n1": "shm"}  # same host: the arena
            assert auto.transport == "shm"
        with ClusterClient(no_master(), initial_map=cmap, transport="tcp") as tcp:
            assert tcp.put(b"k", b"v") is True
            assert tcp.transport == "tcp" and tcp.node_transports() == {"n1": "tcp"}
    finally:
        server.stop()
