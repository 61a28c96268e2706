"""Real network partitions: a local cluster whose nodes each run in a network namespace.

One 1-master 3-node netns cluster serves the module: the layout and the
processes' namespaces, a partition (link down inside the node's namespace)
that the master sees as a dead node while clients get bounded misses, the
heal and re-registration, the fault checker's netns partition, and
`gcache-cluster down` from another process leaving no namespace, veth or
bridge. Skipped where netns_available() is false (not root, no iproute2).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import DEAD
from gcache.cluster.placement import Placement
from gcache.common.processes import pid_alive
from gcache.tools.devcluster import checker, local_cli, netns
from gcache.tools.devcluster.local_cluster import LocalCluster, Member

pytestmark = pytest.mark.cluster  # starts masters

HEARTBEAT_TIMEOUT_S = 1.5
FAST = dict(
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    migration_timeout_s=15.0,
    memory="64MiB",
    disk="128MiB",
)
CALL_BOUND_S = 5.0  # client timeout 0.5 s, one retry: far below this unless a call hangs


def _need_netns():
    avail = netns.netns_available()
    if not avail:
        pytest.skip(f"network namespaces unavailable: {avail.reason}")


def _ip_names(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10).stdout


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    _need_netns()
    d = tmp_path_factory.mktemp("netns") / "cluster"
    c = LocalCluster(d, masters=1, nodes=3, netns=True, **FAST)
    try:
        c.up(timeout_s=60)
        yield c
    finally:
        c.down(timeout_s=10)
        LocalCluster.load(d).down(timeout_s=10)  # idempotent, also after `gcache-cluster down`
        assert netns.leftovers(netns.tag_for(d)) == {"namespaces": [], "links": []}


def test_layout_records_the_network_and_nodes_run_in_their_namespaces(netns_cluster):
    c = netns_cluster
    layout = json.loads((c.dir / "cluster.json").read_text())
    net = layout["network"]
    assert net["mode"] == "netns" and net["bridge"] == c.network.bridge and len(net["bridge"]) <= 15
    assert net["subnet"].startswith("10.") and net["subnet"].endswith(".0/24")
    assert layout["client_url"] == f"gcache://{net['gateway']}:{c.masters[0].ports['grpc']}"
    for m in layout["members"]:
        if m["role"] == "master":
            assert m["host"] == net["gateway"] and m["netns"] == ""
            continue
        assert m["netns"] == f"gcn-{net['tag']}-{m['id']}" and m["veth"].startswith(f"gcv-{net['tag']}-")
        # The recorded pid is the server itself (ip netns exec execs), inside its namespace.
        cmdline = Path(f"/proc/{m['pid']}/cmdline").read_bytes().split(b"\0")
        assert b"gcache.server.main" in cmdline and m["data_dir"].encode() in cmdline
        assert Path(cmdline[0].decode()).name.startswith("python")
        assert _ip_names("netns", "identify", str(m["pid"])).strip() == m["netns"]
    assert len({m.host for m in c.nodes}) == 3
    client = ClusterClient(c.client_url, timeout_s=1.0, transport="tcp")  # namespaces stand in for hosts
    try:
        keys = [f"rt/{i}".encode() for i in range(60)]
        values = [bytes([i]) * (500 + i) for i in range(60)]
        assert all(client.put_batch(keys, values))
        assert client.get_batch(keys) == values
        owners = {Placement(client.cluster_map).owner(k) for k in keys}
        assert owners == {n.id for n in c.nodes}, "every node, in its namespace, serves some keys"
    finally:
        client.close()


def _timed(fn, *args):
    started = time.monotonic()
    result = fn(*args)
    took = time.monotonic() - started
    assert took < CALL_BOUND_S, f"{fn.__name__} took {took:.2f}s during a partition"
    return result


def test_partition_marks_the_node_dead_and_heal_brings_it_back(netns_cluster):
    c = netns_cluster
    # TCP: namespaces stand in for hosts here, and a Unix socket would cross them.
    client = ClusterClient(c.client_url, transport="tcp", timeout_s=0.5, retries=1, map_refresh_s=0.2, suspect_s=1.0)
    victim = c.member("n2")
    try:
        keys = [f"part/{i}".encode() for i in range(300)]
        values = [k * 20 for k in keys]
        assert all(client.put_batch(keys, values))
        placement = Placement(client.cluster_map)
        cut = [i for i, k in enumerate(keys) if placement.owner(k) == victim.id]
        kept = [i for i, k in enumerate(keys) if placement.owner(k) != victim.id]
        assert cut and kept

        started = time.monotonic()
        c.partition(victim)  # checks the cut both ways, raises if traffic still flows
        dead_map = c.wait_map(
            lambda m: m.node(victim.id).state == DEAD, 10 * HEARTBEAT_TIMEOUT_S, f"{victim.id} marked dead"
        )
        time_to_dead_s = time.monotonic() - started
        print(f"time to dead under a real partition: {time_to_dead_s:.2f}s (heartbeat timeout {HEARTBEAT_TIMEOUT_S}s)")
        assert dead_map.node(victim.id).state == DEAD
        assert victim.alive(), "a partition leaves the process running"
        assert c.network.is_partitioned(victim.netns)

        for _ in range(3):  # before and after the client learns the new map
            got = _timed(client.get_batch, [keys[i] for i in cut])
            assert got == [None] * len(cut)
            assert _timed(client.get_batch, [keys[i] for i in kept]) == [values[i] for i in kept]
            assert _timed(client.batch_is_exist, [keys[i] for i in cut]) == [False] * len(cut)

        c.heal(victim)
        assert not c.network.is_partitioned(victim.netns)
        # Its heartbeats reach the master again and are answered "dead"; the agent registers
        # anew (only Register revives a dead node), it joins and becomes active.
        healed = c.wait_active([victim.id], 30)
        assert healed.epoch > dead_map.epoch
        # Same ring as before the partition: the node kept its keys and serves them again.
        deadline = time.monotonic() + 10
        while (got := client.get_batch(keys)) != values and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == values
    finally:
        if c.network.is_partitioned(victim.netns):
            c.heal(victim)
        client.close()


def test_checker_partitions_through_the_network_namespace(netns_cluster):
    lines = []
    report = checker.run_checker(
        netns_cluster,
        seed=11,
        faults=("partition_node",),
        threads=2,
        keys_max=300,
        hold_s=0.5,
        warmup_s=0.5,
        log=lines.append,
    )
    print(json.dumps(report, indent=1))
    assert report["ok"], report
    assert report["exceptions"] == 0 and report["hits"] > 0
    assert "dead_marked_s" in report["timings"] and "rejoin_active_s" in report["timings"]
    assert any("netns partition" in line and "link down" in line for line in lines), lines
    assert not any("SIGSTOP" in line for line in lines), lines


def test_cli_down_removes_processes_namespaces_veths_and_bridge(netns_cluster):
    """Runs last in this module: another process tears the cluster down from cluster.json."""
    c = netns_cluster
    tag = c.network.tag
    pids = [m.pid for m in c.members]
    assert netns.leftovers(tag)["namespaces"] == [n.netns for n in sorted(c.nodes, key=lambda n: n.netns)]
    cmd = [sys.executable, "-m", "gcache.tools.devcluster.local_cli", "down", "--dir", str(c.dir)]
    for _ in range(2):  # the second run finds nothing to do
        down = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
    c._reap()
    assert not any(pid_alive(pid) for pid in pids)
    assert tag not in _ip_names("netns", "list")
    assert tag not in _ip_names("-o", "link", "show")
    assert netns.leftovers(tag) == {"namespaces": [], "links": []}


def test_up_removes_leftovers_of_a_crashed_run(tmp_path):
    _need_netns()
    d = tmp_path / "crashed"
    old = netns.NetnsNetwork.create(d)
    ns, _, _ = old.add_node("n1", 0)
    straggler = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", "import time; print('in', flush=True); time.sleep(60)"],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    try:
        # Inside the namespace before the new run looks (under load `ip netns exec` can still be
        # starting, and then fails with 255 when the namespace goes, instead of being killed).
        assert straggler.stdout is not None and straggler.stdout.readline() == b"in\n"
        new = netns.NetnsNetwork.create(d)  # what up() does first: the old run's pieces go
        assert straggler.wait(timeout=10) == -signal.SIGKILL
        assert netns.leftovers(new.tag) == {
            "namespaces": [],
            "links": sorted([new.bridge, new.keeper, f"gckp-{new.tag}"]),
        }
        assert new.subnet == old.subnet, "the old bridge's subnet was freed before the pick"
    finally:
        if straggler.poll() is None:
            straggler.kill()
            straggler.wait(5)
        if straggler.stdout is not None:
            straggler.stdout.close()
        netns.teardown_tag(netns.tag_for(d))
    assert netns.leftovers(netns.tag_for(d)) == {"namespaces": [], "links": []}


def test_netns_unavailable_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(netns, "netns_available", lambda: netns.Availability(False, "no root here"))
    with pytest.raises(netns.NetnsUnavailableError, match="no root here"):
        LocalCluster(tmp_path / "c", masters=1, nodes=1, netns=True)
    rc = local_cli.main(["up", "--netns", "--masters", "1", "--nodes", "1", "--dir", str(tmp_path / "c")])
    assert rc == local_cli.EXIT_FAILED
    assert "netns mode unavailable: no root here" in capsys.readouterr().err
    assert not (tmp_path / "c" / "cluster.json").exists()


def test_partition_needs_netns_mode(tmp_path):
    c = LocalCluster(tmp_path / "c", masters=1, nodes=1)
    node = Member("node", "n1", "127.0.0.31", {"data": 1, "admin": 2}, str(tmp_path / "n1"), str(tmp_path / "l"))
    with pytest.raises(RuntimeError, match="--netns"):
        c.partition(node)
