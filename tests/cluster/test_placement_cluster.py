"""Weighted placement in a real cluster (issue 21, finding 4): nodes of different
capacities (so different map weights), real clients, a real join and a real drain.

The masters start the map on the rendezvous placement; after each change every key
is where the map's placement says (the node's own index, asked directly), readable
with its exact bytes through a fresh ClusterClient, and the keys that moved moved
only to the joining node or only from the draining one.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from gcache.client.client import ServerClient
from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE, PlacementKind
from gcache.cluster.placement import Placement
from gcache.tools.devcluster.local_cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

KEYS = [b"wp/%d" % i for i in range(600)]
SETTLE_S = 90.0


def value_for(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * (1 + hashlib.sha256(key).digest()[0] % 40)


def where(cluster: LocalCluster, cmap) -> dict[bytes, set[str]]:
    """For each key, the ids of the live nodes that hold it (asked one by one)."""
    held = {k: set() for k in KEYS}
    for node in cmap.nodes:
        with ServerClient(node.address, transport="tcp", timeout_s=5.0) as c:
            for k, present in zip(KEYS, c.batch_is_exist(KEYS)):
                if present:
                    held[k].add(node.id)
    return held


def settled(cluster: LocalCluster, ids):
    return cluster.wait_map(
        lambda m: not m.migrating and sorted(n.id for n in m.nodes if n.state == ACTIVE) == sorted(ids),
        SETTLE_S,
        f"{sorted(ids)} active, nothing migrating",
    )


def check_everything_where_the_map_says(cluster, cmap) -> list:
    owners = Placement(cmap).write.owners(KEYS)
    # Migration runs in the nodes' agents: wait until each key sits at its owner only.
    deadline_map = None
    for _ in range(int(SETTLE_S / 0.5)):
        held = where(cluster, cmap)
        misplaced = [k for k, o in zip(KEYS, owners) if held[k] != {o}]
        if not misplaced:
            break
        deadline_map = misplaced
        time.sleep(0.5)
    else:
        raise AssertionError(f"{len(deadline_map)} keys not (only) at their owner, e.g. {deadline_map[:3]}")
    with ClusterClient(cluster.client_url, timeout_s=5.0) as client:
        assert client.cluster_map.epoch >= cmap.epoch
        values = client.get_batch(KEYS)
    assert [k for k, v in zip(KEYS, values) if v != value_for(k)] == []
    return owners


def test_join_and_drain_at_mixed_weights_move_only_that_nodes_keys(tmp_path):
    cluster = LocalCluster(
        tmp_path / "c",
        masters=1,
        nodes=3,
        memory="32MiB",
        node_disks=["1GiB", "3GiB", "2GiB", "2GiB"],  # weights 1, 3, 2, and the joiner 2
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=3.0,
        migration_timeout_s=60.0,
    )
    cluster.up(timeout_s=90)
    try:
        cmap = settled(cluster, ["n1", "n2", "n3"])
        assert cmap.placement == PlacementKind.RENDEZVOUS
        assert {n.id: n.weight for n in cmap.nodes} == {"n1": 1, "n2": 3, "n3": 2}
        with ClusterClient(cluster.client_url, timeout_s=5.0) as client:
            assert all(client.put_batch(KEYS, [value_for(k) for k in KEYS]))
        before = check_everything_where_the_map_says(cluster, cmap)

        cluster.add_node(timeout_s=SETTLE_S)  # n4, weight 2
        cmap = settled(cluster, ["n1", "n2", "n3", "n4"])
        assert cmap.node("n4").weight == 2
        after_join = check_everything_where_the_map_says(cluster, cmap)
        moved = [(o, n) for o, n in zip(before, after_join) if o != n]
        assert moved and all(new == "n4" for _, new in moved), "a join moves keys only to the joiner"

        cluster.master_client().call("Drain", {"node_id": "n2"})
        cmap = cluster.wait_map(lambda m: m.node("n2") is None and not m.migrating, SETTLE_S, "n2 drained")
        cluster.stop(cluster.member("n2"))
        after_drain = check_everything_where_the_map_says(cluster, cmap)
        moved = [(o, n) for o, n in zip(after_join, after_drain) if o != n]
        assert moved and all(old == "n2" for old, _ in moved), "a drain moves keys only from the drained node"
        assert len(moved) == after_join.count("n2")
    finally:
        cluster.down(timeout_s=20)
