"""`gcache admin`: map / status / drain / remove against a real one-replica gcache-master."""

from __future__ import annotations

import json
import time

import pytest

from gcache.cli import main as cli
from gcache.cluster.cluster_map import ACTIVE
from gcache.common.processes import free_port
from gcache.tools.devcluster.local_server import LocalServer, node_args

pytestmark = pytest.mark.cluster  # starts masters

WAIT_S = 20.0


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """One replica; nodes registered by hand never heartbeat, so they must not expire mid-test."""
    from gcache.cluster.master_api import MasterClient
    from gcache.tools.devcluster.local_masters import start_masters, wait_leader

    masters = start_masters(
        1, tmp_path_factory.mktemp("admin-master"), heartbeat_timeout_s=60, migration_timeout_s=120, tick_s=0.1
    )
    client = MasterClient([m.grpc_address for m in masters], timeout_s=2.0)
    try:
        wait_leader([m.grpc_address for m in masters], timeout_s=WAIT_S)
        yield "gcache://" + ",".join(m.grpc_address for m in masters), client
    finally:
        client.close()
        for m in masters:
            m.kill()


def _register(client, node_id: str) -> None:
    client.call("Register", {"node_id": node_id, "address": f"127.0.0.1:{free_port()}", "weight": 1, "admin": ""})


def _admin(capsys, url: str, *args) -> tuple[int, str, str]:
    code = cli.main(["--timeout-s", "2", "admin", "--master", url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_map_and_status(master, capsys):
    url, client = master
    _register(client, "fake-map")
    code, out, _ = _admin(capsys, url, "map")
    assert code == cli.EXIT_OK
    header, columns, *rows = out.splitlines()
    assert header.startswith("epoch ") and columns.split() == [
        "id",
        "address",
        "weight",
        "state",
        "changed_epoch",
        "admin",
    ]
    assert any(r.split()[0] == "fake-map" for r in rows)
    code, out, _ = _admin(capsys, url, "map", "--json")
    as_json = json.loads(out)
    assert code == cli.EXIT_OK and as_json["epoch"] >= 1
    assert "fake-map" in [n["id"] for n in as_json["nodes"]]
    code, out, _ = _admin(capsys, url, "status")
    assert code == cli.EXIT_OK and "raft:" in out and "fake-map" in out
    code, out, _ = _admin(capsys, url, "status", "--json")
    assert code == cli.EXIT_OK and json.loads(out)["raft"]["is_leader"] is True


def test_drain_and_remove_known_and_unknown_nodes(master, capsys):
    url, client = master
    _register(client, "fake-drain")
    _register(client, "fake-remove")
    code, out, _ = _admin(capsys, url, "drain", "fake-drain")
    assert code == cli.EXIT_OK and "fake-drain: draining" in out
    assert client.get_map().node("fake-drain").state == "draining"
    # A drain that cannot finish (this node never reports): --wait gives up with exit 5.
    code, out, err = _admin(capsys, url, "drain", "fake-drain", "--wait", "--timeout-s", "0.5")
    assert code == cli.EXIT_ERROR and "still in the map" in err
    code, out, _ = _admin(capsys, url, "remove", "fake-remove")
    assert code == cli.EXIT_OK and "removed" in out
    assert client.get_map().node("fake-remove") is None
    for command in ("drain", "remove"):
        code, _, err = _admin(capsys, url, command, "no-such-node")
        assert code == cli.EXIT_MISS and "NOT_FOUND" in err, (command, err)


def test_unreachable_master_and_usage_errors(capsys, monkeypatch):
    code, _, err = _admin(capsys, f"127.0.0.1:{free_port()}", "map")
    assert code == cli.EXIT_UNREACHABLE and "no gcache-master answered" in err
    code, _, err = _admin(capsys, "not-an-address", "map")
    assert code == cli.EXIT_USAGE
    monkeypatch.delenv("GCACHE_MASTER", raising=False)
    assert cli.main(["admin", "--master", "", "status"]) == cli.EXIT_USAGE
    assert "GCACHE_MASTER" in capsys.readouterr().err


def test_drain_wait_until_a_real_node_leaves(master, capsys, tmp_path):
    url, client = master
    for node in client.get_map().nodes:  # hand-registered nodes never report: they would block the join
        client.call("Remove", {"node_id": node.id})
    server = LocalServer(
        tmp_path / "node",
        memory="16MiB",
        disk="0",
        start_timeout_s=WAIT_S,
        extra_args=node_args(masters=url, node_id="real", heartbeat_interval_s=0.2),
    )
    try:
        proc = server.pick_admin_port().start().proc
        deadline = time.monotonic() + WAIT_S
        while (node := client.get_map().node("real")) is None or node.state != ACTIVE:
            assert time.monotonic() < deadline, "node 'real' never became active"
            time.sleep(0.1)
        code, out, _ = _admin(capsys, url, "drain", "real", "--wait", "--timeout-s", str(WAIT_S))
        assert code == cli.EXIT_OK and "real left the map" in out, out
        assert proc.wait(WAIT_S) == 0
    finally:
        server.kill()
