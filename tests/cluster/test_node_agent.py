"""The node side of the cluster: rebalance, the agent's register/heartbeat/map handling, drains.

Real gcache-server processes on loopback ports; a real gcache-master (one
replica) for the agent tests. Every wait is bounded; every process is killed at
teardown.
"""

from __future__ import annotations

import functools
import json
import random
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gcache.client import Client
from gcache.cluster.cluster_map import ACTIVE, DEAD, DRAINING, JOINING, ClusterMap, NodeInfo
from gcache.cluster.placement import Placement
from gcache.common.processes import free_port
from gcache.server.rebalance import rebalance
from gcache.tools.devcluster.local_server import LocalServer, node_args
from tests.support import waiting

pytestmark = pytest.mark.cluster  # starts masters

WAIT_S = 20.0
wait_until = functools.partial(waiting.wait_until, timeout_s=WAIT_S, step_s=0.1)


def _values(n: int, seed: int) -> dict[bytes, bytes]:
    """Keys with mixed sizes (most one size, a few larger), so slot sizing is exercised."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        size = 4096 if i % 10 else rng.choice([100, 20_000, 300_000])
        out[f"k{seed}-{i}".encode()] = rng.randbytes(size)
    return out


def _holdings(addresses: dict[str, str], keys) -> dict[str, set]:
    """{node id: keys it has}."""
    keys = list(keys)
    out = {}
    for node_id, address in addresses.items():
        with Client(address, pool_size=1) as c:
            out[node_id] = {k for k, ok in zip(keys, c.batch_is_exist(keys)) if ok}
    return out


# -- (a) rebalance alone, no master -------------------------------------------------


def _pages(keys):
    """A list_keys_page over a fixed key list, like Server.keys_page (cursor 0 = start/done)."""
    keys = list(keys)

    def page(cursor: int, limit: int):
        end = min(len(keys), cursor + limit)
        return (end if end < len(keys) else 0), keys[cursor:end]

    return page


def _map(servers: dict, states: dict) -> ClusterMap:
    return ClusterMap(
        7, tuple(NodeInfo(nid, s.address, 1, states.get(nid, ACTIVE), 1) for nid, s in sorted(servers.items()))
    )


@pytest.fixture
def three_servers(server_factory):
    return {nid: server_factory(nid) for nid in ("a", "b", "c")}


def test_rebalance_pushes_unowned_keys_to_their_owners_and_removes_them(three_servers):
    servers = three_servers
    values = _values(600, seed=1)
    with Client(servers["a"].address) as a:
        assert all(a.put_batch(list(values), list(values.values())))
    cmap = _map(servers, {})
    result = rebalance(
        cmap,
        "a",
        servers["a"].address,
        list_keys_page=_pages(values),
        batch_bytes=256 << 10,
        keys_page=50,
        keys_pending_max=120,
    )
    placement = Placement(cmap)
    owners = {k: placement.owner(k) for k in values}
    held = _holdings({n: s.address for n, s in servers.items()}, values)
    for node_id in servers:
        assert held[node_id] == {k for k, o in owners.items() if o == node_id}, node_id
    moved = [k for k, o in owners.items() if o != "a"]
    assert result.keys_pushed == len(moved) and result.push_failures == 0
    assert result.bytes_pushed == sum(len(values[k]) for k in moved)
    for node_id in ("b", "c"):
        mine = [k for k in moved if owners[k] == node_id]
        with Client(servers[node_id].address) as c:
            assert c.get_batch(mine) == [values[k] for k in mine]


def test_draining_node_pushes_everything_and_keeps_its_copies(three_servers):
    servers = three_servers
    values = _values(300, seed=2)
    with Client(servers["a"].address) as a:
        assert all(a.put_batch(list(values), list(values.values())))
    cmap = _map(servers, {"a": DRAINING})
    result = rebalance(cmap, "a", servers["a"].address, list_keys_page=_pages(values), batch_bytes=1 << 20)
    assert result.keys_pushed == len(values)
    placement = Placement(cmap)
    held = _holdings({n: s.address for n, s in servers.items()}, values)
    assert held["a"] == set(values)  # still serves fallback reads
    for node_id in ("b", "c"):
        assert held[node_id] == {k for k in values if placement.owner(k) == node_id}
        with Client(servers[node_id].address) as c:
            mine = sorted(held[node_id])
            assert c.get_batch(mine) == [values[k] for k in mine]


def test_drop_mode_removes_unowned_keys_without_pushing(three_servers):
    servers = three_servers
    values = _values(200, seed=3)
    with Client(servers["a"].address) as a:
        assert all(a.put_batch(list(values), list(values.values())))
    cmap = _map(servers, {"a": JOINING})
    result = rebalance(cmap, "a", servers["a"].address, list_keys_page=_pages(values), drop=True)
    placement = Placement(cmap)
    held = _holdings({n: s.address for n, s in servers.items()}, values)
    assert held["a"] == {k for k in values if placement.owner(k) == "a"}
    assert held["b"] == held["c"] == set()
    assert result.keys_dropped == len(values) - len(held["a"]) and result.keys_pushed == 0


def test_unreachable_owner_keeps_its_keys_here(three_servers):
    servers = three_servers
    values = _values(200, seed=4)
    with Client(servers["a"].address) as a:
        assert all(a.put_batch(list(values), list(values.values())))
    servers["c"].kill()
    cmap = _map(servers, {})
    result = rebalance(cmap, "a", servers["a"].address, list_keys_page=_pages(values), keys_pending_max=50)
    placement = Placement(cmap)
    to_c = {k for k in values if placement.owner(k) == "c"}
    held = _holdings({n: servers[n].address for n in ("a", "b")}, values)
    assert held["a"] == {k for k in values if placement.owner(k) in ("a", "c")}
    assert held["b"] == {k for k in values if placement.owner(k) == "b"}
    assert result.push_failures == len(to_c)


# -- (b) agents with a real master ----------------------------------------------------

HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.5
MIGRATION_TIMEOUT_S = 10.0


class NodeProcess(LocalServer):
    """gcache-server --master ...; restartable on the same ports and data dir."""

    def __init__(self, node_id: str, base: Path, masters: str, advertise: str = ""):
        super().__init__(base / node_id, memory="64MiB", disk="128MiB", admin_port=free_port(), start_timeout_s=WAIT_S)
        self.node_id = node_id
        self.extra_args = [
            *node_args(
                masters=masters,
                node_id=node_id,
                advertise=advertise or self.address,  # a test may advertise a dead one
                heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
            ),
            "--rebalance-batch-bytes",
            "4MiB",
            "--shutdown-grace-s",
            "2",
        ]

    def admin(self, path: str, data: bytes | None = None) -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}", data=data, method="POST" if data is not None else "GET"
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.node_id} still running after {timeout_s}s:\n{self.log_tail()}") from None


@pytest.fixture
def cluster(tmp_path, request):
    """One master and nodes added on demand; `request.param` (indirect) sets the migration timeout."""
    from gcache.cluster.master_api import MasterClient
    from gcache.tools.devcluster.local_masters import start_masters, wait_leader

    masters = start_masters(
        1,
        tmp_path / "masters",
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        migration_timeout_s=getattr(request, "param", MIGRATION_TIMEOUT_S),
        tick_s=0.1,
    )
    nodes: list[NodeProcess] = []
    client = None
    try:
        wait_leader([m.grpc_address for m in masters], timeout_s=WAIT_S)
        url = ",".join(m.grpc_address for m in masters)
        client = MasterClient(url, timeout_s=2.0)

        def add_node(node_id: str, advertise: str = "") -> NodeProcess:
            node = NodeProcess(node_id, tmp_path, url, advertise)
            nodes.append(node)
            return node.start()

        yield client, add_node
    finally:
        for node in nodes:
            node.kill()
        for m in masters:
            m.kill()
        if client is not None:
            client.close()


def _states(client) -> dict:
    cmap = client.get_map()
    return {n.id: n.state for n in cmap.nodes} if cmap else {}


def _wait_states(client, expected: dict, what: str, timeout_s: float = WAIT_S) -> ClusterMap:
    wait_until(lambda: _states(client) == expected, f"{what}: map {expected}", timeout_s=timeout_s)
    return client.get_map()


def _check_at_owners(cmap: ClusterMap, values: dict, nodes: dict) -> dict:
    """How many keys are readable, exact bytes, at their write owner."""
    placement = Placement(cmap)
    by_owner: dict[str, list] = {}
    for k in values:
        by_owner.setdefault(placement.owner(k), []).append(k)
    found = 0
    for owner, keys in by_owner.items():
        with Client(nodes[owner].address) as c:
            got = c.get_batch(keys)
        found += sum(1 for k, v in zip(keys, got) if v == values[k])
    return found


def test_cluster_drain_join_dead_and_return(cluster):
    master, add_node = cluster
    nodes = {nid: add_node(nid) for nid in ("n1", "n2", "n3")}
    cmap = _wait_states(master, dict.fromkeys(nodes, ACTIVE), "three nodes active")

    # Write through single-node clients to the owners, as a cluster client would.
    values = {f"key-{i}".encode(): random.Random(i).randbytes(16 << 10) for i in range(2000)}
    placement = Placement(cmap)
    for nid, node in nodes.items():
        mine = [k for k in values if placement.owner(k) == nid]
        with Client(node.address, epoch=cmap.epoch) as c:
            assert all(c.put_batch(mine, [values[k] for k in mine]))
    assert _check_at_owners(cmap, values, nodes) == len(values)

    # Active failover by the operator: POST /drain -> drain, push, leave, exit 0.
    n1_keys = [k for k in values if placement.owner(k) == "n1"]
    start = time.monotonic()
    status, body = nodes["n1"].admin("/drain", b"test")
    assert status == 202 and "POST /drain" in json.loads(body)["degraded"]
    assert nodes["n1"].wait_exit(WAIT_S) == 0, nodes["n1"].log_tail()
    drain_s = time.monotonic() - start
    cmap = _wait_states(master, {"n2": ACTIVE, "n3": ACTIVE}, "n1 gone")
    placement = Placement(cmap)
    at_new_owner = 0
    for k in n1_keys:
        with Client(nodes[placement.owner(k)].address) as c:
            at_new_owner += c.get(k) == values[k]
    assert at_new_owner >= 0.99 * len(n1_keys), (at_new_owner, len(n1_keys))
    pushes = [line.split("rebalance ", 1)[1] for line in nodes["n1"].log_tail(20000).splitlines() if "(push)" in line]
    print(f"\ndrain: n1 exited 0 {drain_s:.2f}s after POST /drain; last push: {pushes[-1:]}")

    # Restarted after its drain (what a DaemonSet does), n1 stays out of the cluster.
    assert (nodes["n1"].data_dir / "DRAINED").exists()
    nodes["n1"].start()
    time.sleep(5 * HEARTBEAT_INTERVAL_S)
    assert "n1" not in _states(master), nodes["n1"].log_tail()
    with pytest.raises(urllib.error.HTTPError) as answer:
        nodes["n1"].admin("/readyz")
    assert answer.value.code == 503
    nodes["n1"].kill()
    del nodes["n1"]

    # Join: n4 enters joining, the others push its keys, it becomes active.
    nodes["n4"] = add_node("n4")
    wait_until(lambda: _states(master).get("n4") in (JOINING, ACTIVE), "n4 registered")
    cmap = _wait_states(master, {"n2": ACTIVE, "n3": ACTIVE, "n4": ACTIVE}, "n4 active")
    wait_until(lambda: _check_at_owners(cmap, values, nodes) >= 0.99 * len(values), "keys at owners after join")
    placement = Placement(cmap)
    held = _holdings({n: nodes[n].address for n in nodes}, values)
    for nid in nodes:  # pushed keys were removed at their old nodes
        assert held[nid] == {k for k in values if placement.owner(k) == nid}, nid
    _, cluster_view = nodes["n2"].admin("/cluster")
    print(f"join: n2 rebalance counters {json.loads(cluster_view)['rebalance']}")
    _, metrics = nodes["n2"].admin("/metrics")
    assert "gcache_rebalance_keys_pushed_total" in metrics and "gcache_cluster_epoch " in metrics

    # kill -9: n2 first gets keys it does not own (a standalone client), flushed to disk.
    foreign = {f"foreign-{i}".encode(): b"x" * 1000 for i in range(50)}
    foreign = {k: v for k, v in foreign.items() if placement.owner(k) != "n2"}
    n2_keys = [k for k in values if placement.owner(k) == "n2"]
    with Client(nodes["n2"].address) as c:
        assert all(c.put_batch(list(foreign), list(foreign.values())))
    assert nodes["n2"].admin("/flush", b"")[0] == 200
    nodes["n2"].kill()
    start = time.monotonic()
    wait_until(lambda: _states(master).get("n2") == DEAD, "n2 dead")
    print(
        f"dead: n2 marked dead {time.monotonic() - start:.2f}s after kill -9 (heartbeat timeout {HEARTBEAT_TIMEOUT_S}s)"
    )

    # Restart on the same dir: it rejoins, drops what it does not own, keeps what it does.
    nodes["n2"].start()
    cmap = _wait_states(master, {"n2": ACTIVE, "n3": ACTIVE, "n4": ACTIVE}, "n2 back and active")
    wait_until(lambda: not any(_holdings({"n2": nodes["n2"].address}, foreign)["n2"]), "foreign keys dropped")
    held = _holdings({n: nodes[n].address for n in nodes}, foreign)
    assert held == {"n2": set(), "n3": set(), "n4": set()}  # dropped, not pushed
    with Client(nodes["n2"].address) as c:
        back = sum(1 for k, v in zip(n2_keys, c.get_batch(n2_keys)) if v == values[k])
    assert back >= 0.99 * len(n2_keys), (back, len(n2_keys))


# -- flags, degradation triggers, standalone and masterless nodes --------------------------


def test_cluster_flags_are_validated_with_clear_errors(tmp_path):
    from gcache.server.config import ConfigError, load_settings

    toml = tmp_path / "node.toml"
    toml.write_text(
        'master = "m1:7700,m2:7700"\nnode-id = "gpu-7"\nadvertise = "10.0.0.7:7600"\n'
        "heartbeat_interval_s = 0.5\nmemory-pressure-drain = 0.2\n"
    )
    s = load_settings(["--config", str(toml), "--host", "0.0.0.0"])
    assert (s.master, s.node_id, s.advertise, s.heartbeat_interval_s, s.memory_pressure_drain) == (
        "m1:7700,m2:7700",
        "gpu-7",
        "10.0.0.7:7600",
        0.5,
        0.2,
    )

    s = load_settings(["--master", "gcache://h1:1,h2:2", "--port", "7000", "--rebalance-batch-bytes", "8MiB"])
    assert (s.node_id_or_default(), s.advertise_address(), s.rebalance_batch_bytes) == (
        "127.0.0.1:7000",
        "127.0.0.1:7000",
        8 << 20,
    )
    assert load_settings([]).master == ""  # standalone by default
    for argv, message in [
        (["--master", "h1"], "not host:port"),
        (["--master", "h:1", "--host", "0.0.0.0"], "--advertise"),
        (["--advertise", "0.0.0.0:7"], "wildcard"),
        (["--heartbeat-interval-s", "0"], "--heartbeat-interval-s"),
        (["--rebalance-batch-bytes", "4KiB"], "--rebalance-batch-bytes"),
        (["--memory-pressure-drain", "1.5"], "fraction"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_settings(argv)


def test_degradation_triggers(tmp_path):
    from gcache.server.degradation import DegradationMonitor

    counters = {"disk_errors": 0, "checksum_failures": 0, "puts_stored": 0, "puts_no_space": 0}
    stats = lambda: {"counters": dict(counters)}  # noqa: E731
    monitor = DegradationMonitor(stats, str(tmp_path))
    assert monitor.check() == ""
    (tmp_path / "DRAIN").touch()
    assert "DRAIN" in monitor.check()
    (tmp_path / "DRAIN").unlink()
    assert "DRAIN" in monitor.check()  # a drain is not undone

    disk = DegradationMonitor(stats, str(tmp_path))
    assert disk.check() == ""
    counters["disk_errors"] += 1
    assert disk.check().startswith("disk:")

    memory = DegradationMonitor(stats, str(tmp_path), memory_pressure_fraction=0.5)
    assert memory.check() == ""
    counters["puts_stored"] += 100
    counters["puts_no_space"] += 50  # 50 of 150: a third, under the fraction
    assert memory.check() == ""
    counters["puts_no_space"] += 200  # 250 of 350 since the first sample
    assert memory.check().startswith("memory pressure")
    assert DegradationMonitor(stats, None).request("") == "operator request"


def test_standalone_node_has_no_cluster_and_refuses_drain(server):
    import urllib.error

    with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/cluster", timeout=5) as r:
        assert json.loads(r.read()) == {"cluster": False}
    request = urllib.request.Request(f"http://127.0.0.1:{server.admin_port}/drain", data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 409


def test_node_serves_data_while_no_master_answers(server_factory):
    node = server_factory(
        "lonely", extra_args=["--master", f"127.0.0.1:{free_port()}", "--heartbeat-interval-s", "0.2"]
    )
    with Client(node.address) as c:
        assert c.put(b"k", b"v") and c.get(b"k") == b"v"
    with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/cluster", timeout=5) as r:
        view = json.loads(r.read())
    assert view["registered"] is False and view["epoch"] == 0
    assert node.stop() == 0  # SIGTERM still stops it cleanly


SLOW_MIGRATION_S = 45.0  # longer than a loaded machine needs to start pushing and log a retry


@pytest.mark.parametrize("cluster", [SLOW_MIGRATION_S], indirect=True)
def test_a_drain_does_not_finish_while_an_owner_cannot_be_reached(cluster):
    """n2 heartbeats but advertises a port nothing listens on: n1's keys for n2 cannot be
    pushed, so n1 stays draining (its copies still served) until the master's migration
    timeout ends the drain, instead of leaving at once and losing them."""
    master, add_node = cluster
    nodes = {"n1": add_node("n1"), "n2": add_node("n2", advertise=f"127.0.0.1:{free_port()}"), "n3": add_node("n3")}
    cmap = _wait_states(master, dict.fromkeys(nodes, ACTIVE), "three nodes active")
    placement = Placement(cmap)
    mine = [k for k in (f"k{i}".encode() for i in range(400)) if placement.owner(k) == "n1"]
    with Client(nodes["n1"].address, epoch=cmap.epoch) as c:
        assert all(c.put_batch(mine, [k * 50 for k in mine]))
    after = Placement(cmap.with_node(cmap.node("n1")._replace(state=DRAINING)))
    to_n2 = [k for k in mine if after.owner(k) == "n2"]
    to_n3 = [k for k in mine if after.owner(k) == "n3"]
    assert to_n2 and to_n3

    master.call("Drain", {"node_id": "n1"})
    wait_until(lambda: "retrying" in nodes["n1"].log_tail(20000), "n1 retries the unreachable owner", timeout_s=30)
    assert _states(master).get("n1") == DRAINING, "a drain with unpushed keys must not complete"
    with Client(nodes["n3"].address) as c:  # what could be pushed was pushed
        assert c.get_batch(to_n3) == [k * 50 for k in to_n3]
    with Client(nodes["n1"].address) as c:  # and n1 still serves everything
        assert c.get_batch(mine) == [k * 50 for k in mine]
    # The master's migration timeout ends it; n1 then leaves and exits 0.
    assert nodes["n1"].wait_exit(SLOW_MIGRATION_S + WAIT_S) == 0, nodes["n1"].log_tail()
    assert "n1" not in _states(master)


def test_repeated_run_skips_keys_the_owner_already_has(three_servers):
    """A draining node retrying the same map (an owner was down) pushes only what is missing."""
    from gcache.server.rebalance import Rebalancer

    servers = three_servers
    values = _values(300, seed=5)
    with Client(servers["a"].address) as a:
        assert all(a.put_batch(list(values), list(values.values())))
    cmap = _map(servers, {"a": DRAINING})
    placement = Placement(cmap)
    to_b = {k for k in values if placement.owner(k) == "b"}
    to_c = {k for k in values if placement.owner(k) == "c"}
    servers["c"].kill()
    rebalancer = Rebalancer("a", servers["a"].address, list_keys_page=_pages(values), batch_bytes=1 << 20)
    try:
        first = rebalancer.run(cmap)
        assert not first.complete and first.push_unreachable == len(to_c)
        assert first.keys_pushed == len(to_b)
        servers["c"].start()  # same port, same map: the agent would run this map again
        second = rebalancer.run(cmap)
    finally:
        rebalancer.close()
    assert second.complete and second.keys_present == len(to_b)
    assert second.keys_pushed == len(to_c) and second.bytes_pushed == sum(len(values[k]) for k in to_c)
    held = _holdings({n: s.address for n, s in servers.items()}, values)
    assert held["a"] == set(values) and held["b"] == to_b and held["c"] == to_c
    with Client(servers["c"].address) as c:
        mine = sorted(to_c)
        assert c.get_batch(mine) == [values[k] for k in mine]
