"""A real local cluster (3 masters, 3 nodes, each process on its own loopback address).

Covers `gcache-cluster up/down`, the master staying off the IO path, and the
seeded fault checker: kill -9 the leader, kill -9 / SIGSTOP / partition a node,
drain and join, with concurrent content-addressed clients.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from gcache.client.client import Client
from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE
from gcache.cluster.master_api import MasterUnavailableError
from gcache.cluster.placement import Placement
from gcache.common.processes import pid_alive
from gcache.tools.devcluster import checker
from gcache.tools.devcluster.local_cluster import LocalCluster
from gcache.tools.devcluster.netns import netns_available

pytestmark = pytest.mark.cluster  # starts masters

FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5, migration_timeout_s=15.0, memory="64MiB", disk="128MiB")


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path / "cluster", masters=3, nodes=3, **FAST)
    c.up(timeout_s=60)
    yield c
    c.down(timeout_s=10)
    assert not any(m.alive() for m in c.members)


def test_cli_up_writes_layout_and_down_stops_every_process(tmp_path):
    d = tmp_path / "cli"
    cmd = [sys.executable, "-m", "gcache.tools.devcluster.local_cli"]
    up = subprocess.run(
        cmd
        + [
            "up",
            "--masters",
            "1",
            "--nodes",
            "2",
            "--dir",
            str(d),
            "--heartbeat-interval-s",
            "0.2",
            "--memory",
            "32MiB",
            "--disk",
            "64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    layout = json.loads((d / "cluster.json").read_text()) if (d / "cluster.json").exists() else {}
    pids = [m["pid"] for m in layout.get("members", [])]
    try:
        assert up.returncode == 0, up.stderr
        assert json.loads(up.stdout)["client_url"] == layout["client_url"]
        assert sorted(m["role"] for m in layout["members"]) == ["master", "node", "node"]
        hosts = [m["host"] for m in layout["members"]]
        assert len(set(hosts)) == 3, "every process has its own loopback address"
        with Client(layout["client_url"]) as client:
            assert isinstance(client, ClusterClient)
            assert client.put(b"k", b"v" * 1000) is True
            assert client.get(b"k") == b"v" * 1000
        status = subprocess.run(cmd + ["status", "--dir", str(d)], capture_output=True, text=True, timeout=30)
        assert status.returncode == 0 and status.stdout.count(" active") == 2, status.stdout
        cli = [sys.executable, "-m", "gcache.cli.main", "--server", layout["client_url"]]
        ping = subprocess.run(cli + ["ping"], capture_output=True, text=True, timeout=30)
        assert ping.returncode == 0 and ping.stdout.count(": version") == 2, ping.stdout + ping.stderr
        stats = subprocess.run(cli + ["stats"], capture_output=True, text=True, timeout=30)
        assert stats.returncode == 0 and stats.stdout.count("== node") == 2, stats.stdout
    finally:
        down = subprocess.run(cmd + ["down", "--dir", str(d)], capture_output=True, text=True, timeout=90)
    assert down.returncode == 0, down.stderr
    # Exited (at most a zombie left for whoever adopted the orphan to reap).
    assert pids and not any(pid_alive(pid) for pid in pids)


def test_clients_keep_reading_and_writing_with_every_master_stopped(cluster):
    client = ClusterClient(cluster.client_url, timeout_s=1.0, map_refresh_s=0.2)
    try:
        keys = [f"off-path/{i}".encode() for i in range(200)]
        values = [bytes([i % 251]) * (100 + i) for i in range(200)]
        assert all(client.put_batch(keys[:100], values[:100]))
        for m in cluster.masters:
            cluster.stop(m, signal.SIGKILL)
        assert all(client.put_batch(keys[100:], values[100:]))
        assert client.get_batch(keys) == values
        assert client.batch_exists_prefix(keys) == len(keys)
        with pytest.raises(MasterUnavailableError):  # a new client needs some master to start
            ClusterClient(cluster.client_url, timeout_s=0.5, master_timeout_s=0.5)
    finally:
        client.close()


def test_values_live_only_on_their_owner_and_survive_a_full_master_restart(cluster):
    client = ClusterClient(cluster.client_url, timeout_s=1.0)
    try:
        keys = [f"owner/{i}".encode() for i in range(300)]
        assert all(client.put_batch(keys, [k * 3 for k in keys]))
        cmap = cluster.current_map()
        placement = Placement(cmap)
        for node in cmap.nodes:
            with Client(node.address) as direct:
                present = direct.batch_is_exist(keys)
            assert present == [placement.owner(k) == node.id for k in keys]
    finally:
        client.close()
    epoch = cmap.epoch
    for m in cluster.masters:
        cluster.stop(m)
    for m in cluster.masters:
        cluster.start(m)
    cluster.wait_leader(60)
    restarted = cluster.wait_map(lambda m: m.epoch >= epoch and len(m.nodes) == 3, 30, "map after restart")
    assert {n.id for n in restarted.nodes} == {n.id for n in cmap.nodes}
    assert all(n.state == ACTIVE for n in cluster.wait_active([n.id for n in cmap.nodes], 30).nodes)


def test_checker_reports_wrong_bytes(cluster):
    """The checker must be able to fail: plant a wrong value at a key's owner and read it."""
    client = ClusterClient(cluster.client_url, timeout_s=1.0)
    try:
        key = checker.key_for(99, 1)
        owner = Placement(client.cluster_map).owner(key)
        with Client(client.cluster_map.node(owner).address) as direct:
            assert direct.put(key, b"not the value of this key")
        worker = checker.ClientWorker(client, 99, 0, 10, stop=None)
        worker._verify([key], client.get_batch([key]))
        assert worker.tally.violations and "WRONG BYTES" in worker.tally.violations[0]
    finally:
        client.close()


def test_seeded_faults_never_return_wrong_bytes_or_block(tmp_path):
    """Every fault, with a real partition (network namespaces) where this machine has them."""
    netns = bool(netns_available())
    cluster = LocalCluster(tmp_path / "faults", masters=3, nodes=3, netns=netns, **FAST)
    cluster.up(timeout_s=60)
    lines = []
    try:
        report = checker.run_checker(
            cluster, seed=5, threads=3, keys_max=600, hold_s=0.5, warmup_s=0.5, log=lines.append
        )
    finally:
        cluster.down(timeout_s=10)
    assert any("netns partition" in line for line in lines) == netns, lines
    print(json.dumps(report, indent=1))
    assert report["violations"] == []
    assert report["fault_errors"] == [] and report["settle_problems"] == []
    assert report["exceptions"] == 0 and report["slowest_call_s"] <= report["call_bound_s"]
    assert report["hits"] > 0 and report["puts_stored"] > 0
    assert set(report["timings"]) >= {"leader_takeover_s", "dead_marked_s", "drain_s", "join_active_s"}
