"""Three real gcache-master processes on 127.0.0.21-23: membership, failover, restart.

The tests share one cluster and run in file order (each leaves it whole again).
Fake node ids stand in for gcache-servers: the master only keeps the map.
"""

import functools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from gcache.cluster.master_api import MasterClient, MasterUnavailableError
from gcache.common.processes import free_port
from gcache.tools.devcluster.local_masters import LocalMaster, master_status, start_masters, wait_leader
from tests.support import waiting

pytestmark = pytest.mark.cluster  # starts masters

HEARTBEAT_TIMEOUT_S = 1.5
HEARTBEAT_EVERY_S = 0.2
WAIT_S = 15.0  # bound on every wait for a state: generous for a loaded 2-core box
wait_until = functools.partial(waiting.wait_until, timeout_s=WAIT_S, step_s=0.05)
ECHO = "echo"  # heartbeat mode: report the last epoch seen as rebalanced


class Heartbeater:
    """Heartbeats fake nodes through every master, like the nodes' cluster agents would."""

    def __init__(self, addresses):
        self.client = MasterClient(addresses, timeout_s=0.5)
        self.modes: dict[str, object] = {}  # node id -> ECHO or a fixed rebalanced epoch
        self.last_epoch: dict[str, int] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop_event.wait(HEARTBEAT_EVERY_S):
            for node_id, mode in list(self.modes.items()):
                rebalanced = self.last_epoch.get(node_id, 0) if mode == ECHO else mode
                try:
                    answer = self.client.call(
                        "Heartbeat", {"node_id": node_id, "epoch": 0, "rebalanced_epoch": rebalanced, "degraded": ""}
                    )
                except (MasterUnavailableError, grpc.RpcError):
                    continue  # masters restarting: keep trying
                self.last_epoch[node_id] = answer["epoch"]

    def close(self):
        self.stop_event.set()
        self.thread.join(5)
        self.client.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("masters")
    masters = start_masters(
        3, base, http=True, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, migration_timeout_s=60, tick_s=0.1
    )
    beats = None
    try:
        addresses = [m.grpc_address for m in masters]
        wait_leader(addresses, WAIT_S)
        beats = Heartbeater(addresses)
        yield masters, beats
    finally:
        if beats is not None:
            beats.close()
        for m in masters:
            m.kill()


def addresses_of(masters):
    return [m.grpc_address for m in masters]


def register(client, node_id, port):
    return client.call("Register", {"node_id": node_id, "address": f"127.0.0.1:{port}", "weight": 4, "admin": ""})


def states(address):
    status = master_status(address)
    return {n["id"]: n["state"] for n in status["map"]["nodes"]} if status else {}


def leader_and_follower(masters):
    leader = wait_leader(addresses_of(masters), WAIT_S)
    return leader, next(a for a in addresses_of(masters) if a != leader)


def converged(masters):
    """The map once every running replica holds the same one."""
    maps = [master_status(m.grpc_address) for m in masters if m.alive()]
    if all(maps) and len({json.dumps(s["map"], sort_keys=True) for s in maps}) == 1:
        return maps[0]["map"]
    return None


def test_follower_forwards_registers_and_heartbeats_make_nodes_active(cluster):
    masters, beats = cluster
    leader, follower = leader_and_follower(masters)
    via_follower = MasterClient([follower])
    epochs = []
    for i, node_id in enumerate(["a", "b", "c"]):
        answer = register(via_follower, node_id, 9000 + i)
        assert answer["state"] == "joining"
        epochs.append(answer["map"]["epoch"])
        beats.modes[node_id] = ECHO
    # each register changes the map; a heartbeat that activates a node in between may too
    assert all(later > earlier for earlier, later in zip(epochs, epochs[1:])), epochs
    assert register(via_follower, "a", 9000)["map"]["epoch"] >= epochs[-1]  # idempotent
    wait_until(lambda: states(leader) == {"a": "active", "b": "active", "c": "active"}, "a, b, c active")
    final = wait_until(lambda: converged(masters), "replicas to agree")
    assert {n["id"] for n in final["nodes"]} == {"a", "b", "c"}
    status = master_status(leader)
    assert status["raft"]["is_leader"] and status["raft"]["ready"]
    assert set(status["heartbeat_age_s"]) == {"a", "b", "c"}
    assert all(age < HEARTBEAT_TIMEOUT_S for age in status["heartbeat_age_s"].values())
    assert MasterClient([follower]).get_map(if_newer_than=final["epoch"]) is None
    assert MasterClient([follower]).get_map().epoch == final["epoch"]
    via_follower.close()


def test_http_probe_answers_health_readiness_and_map(cluster):
    masters, _ = cluster
    m = masters[0]
    base = f"http://{m.http_address}"
    assert urllib.request.urlopen(f"{base}/healthz", timeout=2).status == 200
    ready = json.loads(urllib.request.urlopen(f"{base}/readyz", timeout=2).read())
    assert ready["ready"] and ready["leader"]
    as_json = json.loads(urllib.request.urlopen(f"{base}/map", timeout=2).read())
    assert {n["id"] for n in as_json["nodes"]} >= {"a", "b", "c"}
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/nope", timeout=2)
    assert e.value.code == 404


def test_joining_node_turns_active_only_after_the_others_rebalance(cluster):
    masters, beats = cluster
    client = MasterClient(addresses_of(masters))
    held = {node_id: beats.last_epoch.get(node_id, 0) for node_id in ("a", "b", "c")}
    beats.modes.update(held)  # a, b, c stop reporting progress
    joined_at = register(client, "d", 9003)["map"]["epoch"]
    beats.modes["d"] = ECHO
    time.sleep(1.0)
    assert states(client.addresses[0])["d"] == "joining"
    for node_id in ("a", "b", "c"):
        beats.modes[node_id] = ECHO  # they finish pushing keys to d
    wait_until(lambda: states(masters[1].grpc_address).get("d") == "active", "d active")
    assert min(master_status(masters[0].grpc_address)["rebalanced_epoch"][n] for n in "abc") >= joined_at
    client.close()


def test_silent_node_becomes_dead_then_may_register_again(cluster):
    masters, beats = cluster
    client = MasterClient(addresses_of(masters))
    register(client, "e", 9004)
    beats.modes["e"] = ECHO
    wait_until(lambda: states(masters[0].grpc_address).get("e") == "active", "e active")
    del beats.modes["e"]
    silent_since = time.monotonic()
    time.sleep(0.3)
    assert states(masters[2].grpc_address)["e"] != "dead"  # well inside the timeout
    wait_until(lambda: states(masters[2].grpc_address).get("e") == "dead", "e dead")
    print(f"\nsilent node declared dead after {time.monotonic() - silent_since:.2f}s (timeout {HEARTBEAT_TIMEOUT_S}s)")
    answer = client.call("Heartbeat", {"node_id": "e", "epoch": 0, "rebalanced_epoch": 0, "degraded": ""})
    assert answer["state"] == "dead"
    with pytest.raises(grpc.RpcError) as e:
        client.call("Drain", {"node_id": "e"})
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert register(client, "e", 9014)["state"] == "joining"
    client.call("Remove", {"node_id": "e"})
    unknown = client.call("Heartbeat", {"node_id": "e", "epoch": 0, "rebalanced_epoch": 0, "degraded": ""})
    assert unknown["state"] == "unknown"
    client.close()


def test_drained_node_is_removed_once_it_reports_the_current_epoch(cluster):
    masters, beats = cluster
    _, follower = leader_and_follower(masters)
    via_follower = MasterClient([follower])
    with pytest.raises(grpc.RpcError) as e:
        via_follower.call("Drain", {"node_id": "ghost"})
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        via_follower.call("Register", {"node_id": "x", "address": "nohost", "weight": 1})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    beats.modes["d"] = beats.last_epoch.get("d", 0)  # d has not pushed anything yet
    answer = via_follower.call("Drain", {"node_id": "d"})
    assert {n["id"]: n["state"] for n in answer["map"]["nodes"]}["d"] == "draining"
    time.sleep(1.0)
    assert states(follower)["d"] == "draining"
    beats.modes["d"] = ECHO
    wait_until(lambda: "d" not in states(follower), "d removed")
    del beats.modes["d"]
    via_follower.close()


def test_one_replica_down_the_others_stay_writable(cluster):
    masters, _ = cluster
    leader, follower = leader_and_follower(masters)
    down = next(m for m in masters if m.grpc_address == follower)
    assert down.stop(signal.SIGTERM) == 0
    client = MasterClient(addresses_of(masters))
    assert register(client, "f", 9005)["state"] == "joining"
    assert client.call("Remove", {"node_id": "f"})["map"]["epoch"] > 0
    down.start()
    wait_until(lambda: converged(masters), "the restarted replica to catch up")
    client.close()


def test_leader_killed_a_new_one_takes_over_with_the_map_intact(cluster):
    masters, _ = cluster
    leader, _ = leader_and_follower(masters)
    before = wait_until(lambda: converged(masters), "replicas to agree")
    victim = next(m for m in masters if m.grpc_address == leader)
    victim.kill()
    killed_at = time.monotonic()
    new_leader = wait_leader(addresses_of(masters), WAIT_S)
    print(f"\nleader takeover after kill -9: {time.monotonic() - killed_at:.2f}s")
    assert new_leader != leader
    after = master_status(new_leader)["map"]
    assert after["epoch"] >= before["epoch"]
    assert {n["id"] for n in after["nodes"]} == {n["id"] for n in before["nodes"]}
    client = MasterClient(addresses_of(masters))
    assert register(client, "g", 9006)["map"]["epoch"] > after["epoch"]
    client.call("Remove", {"node_id": "g"})
    # a, b, c kept heartbeating through the election: nobody was declared dead.
    time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)
    assert states(new_leader) == {"a": "active", "b": "active", "c": "active"}
    victim.start()
    wait_until(lambda: converged(masters), "the old leader to rejoin as follower")
    client.close()


def test_full_restart_keeps_the_map(cluster):
    masters, beats = cluster
    before = wait_until(lambda: converged(masters), "replicas to agree")
    assert before["nodes"] and all(n["state"] == "active" for n in before["nodes"])
    for m in masters:
        assert m.stop(signal.SIGTERM) == 0
    # A lone replica has no quorum: not ready, and writes fail fast with UNAVAILABLE.
    masters[0].start()
    # gRPC backs off reconnecting to an address that refused us while it was down: wait it out.
    wait_until(lambda: master_status(masters[0].grpc_address), "the lone replica to answer")
    lone = MasterClient([masters[0].grpc_address], timeout_s=3.0)
    with pytest.raises(MasterUnavailableError, match="retry"):
        lone.call("Drain", {"node_id": "a"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{masters[0].http_address}/readyz", timeout=2)
    assert e.value.code == 503
    # Reads still answer from the replica's copy: the entries it knew committed (its durable
    # commit index may trail by up to a second; the rest commit once a leader is back).
    assert 0 < lone.get_map().epoch <= before["epoch"]
    lone.close()
    for m in masters[1:]:
        m.start()
    wait_leader(addresses_of(masters), WAIT_S)
    after = wait_until(lambda: converged(masters), "replicas to agree")
    assert after == before


def _start_expecting_exit(args, timeout_s=30.0) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "gcache.master.main", *args], capture_output=True, text=True, timeout=timeout_s
    )
    return proc.returncode, proc.stderr


def test_ports_in_use_exit_3_and_a_shared_data_dir_exits_2(tmp_path):
    host = "127.0.0.24"
    with socket.socket() as taken:
        taken.bind((host, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, err = _start_expecting_exit(
            ["--grpc", f"{host}:{port}", "--raft", f"{host}:{free_port(host)}", "--data-dir", str(tmp_path / "a")]
        )
        assert code == 3, err
        assert "--grpc" in err
        code, err = _start_expecting_exit(
            ["--grpc", f"{host}:{free_port(host)}", "--raft", f"{host}:{port}", "--data-dir", str(tmp_path / "b")]
        )
        assert code == 3, err
        assert "--raft" in err
    first = LocalMaster(
        tmp_path / "c",
        grpc_address=f"{host}:{free_port(host)}",
        raft_address=f"{host}:{free_port(host)}",
        log_path=tmp_path / "c.log",
    )
    try:
        first.start()
        code, err = _start_expecting_exit(
            [
                "--grpc",
                f"{host}:{free_port(host)}",
                "--raft",
                f"{host}:{free_port(host)}",
                "--data-dir",
                str(tmp_path / "c"),
            ]
        )
        assert code == 2 and "in use" in err
        assert first.stop(signal.SIGINT) == 0
    finally:
        first.kill()


def test_log_compaction_writes_a_dump_that_a_restart_loads(tmp_path):
    """In-process single replica: force a compaction, restart on the same data dir, same state."""
    from pysyncobj import SyncObjException

    from gcache.master.raft_state import DUMP_FILE, MasterRaft, ReplicatedMap

    host = "127.0.0.97"  # no other test's replicas live there (start_masters uses .21 on)

    def start(address):
        raft = MasterRaft(address, [], str(tmp_path), ReplicatedMap())
        try:
            raft.waitBinded()
        except SyncObjException:
            raft.close()
            raise
        wait_until(raft.is_leader, "a leader")
        return raft

    for attempt in range(3):  # free_port is a probe: the port can be taken before the bind
        address = f"{host}:{free_port(host)}"
        try:
            raft = start(address)
            break
        except SyncObjException:
            if attempt == 2:
                raise
    try:
        raft.apply("register", "n1", "10.0.0.1:7600", 4, "", timeout_s=5)
        raft.apply("activate", "n1", 1, True, timeout_s=5)
        for epoch in range(3):
            raft.apply("heartbeat", "n1", epoch, "", timeout_s=5)
        before = raft.snapshot()
        raft.forceLogCompaction()
        wait_until(lambda: (tmp_path / DUMP_FILE).exists() and raft._getRaftLogSize() <= 2, "the dump")
    finally:
        raft.close()
    raft = start(address)
    try:
        after = raft.snapshot()
        assert (after.map, after.rebalanced) == (before.map, before.rebalanced)
        assert after.map.epoch == 2 and after.rebalanced == {"n1": 2}
    finally:
        raft.close()
