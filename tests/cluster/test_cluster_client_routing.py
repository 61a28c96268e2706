"""How the cluster client routes a batch by Placement.group: every key's answer
lands at that key's position, whatever owners, retries and fallbacks it took.

No server runs: each part's function answers from the node's address and the
epoch its request would carry (NodeClient.epoch inside the call), so these
check the routing alone; tests/cluster/test_cluster_client.py runs the same paths
against real nodes.
"""

from __future__ import annotations

import hashlib
import threading

import msgpack
import pytest

from gcache import errors
from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE, JOINING, ClusterMap, NodeInfo
from gcache.cluster.placement import Placement

KEYS = [hashlib.sha256(f"route-{i}".encode()).hexdigest().encode() for i in range(600)]
ADDRESSES = {nid: f"127.0.0.1:{port}" for nid, port in (("a", 1), ("b", 2), ("c", 3), ("d", 4))}


def make_map(epoch: int, states: dict[str, str]) -> ClusterMap:
    return ClusterMap.from_dict(
        {
            "epoch": epoch,
            "nodes": [NodeInfo(nid, ADDRESSES[nid], 1, st).to_dict() for nid, st in sorted(states.items())],
        }
    )


@pytest.fixture
def make_client():
    clients = []

    def make(cmap: ClusterMap) -> ClusterClient:
        clients.append(ClusterClient(initial_map=cmap, timeout_s=0.5))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


def node_of(client) -> str:
    return next(nid for nid, addr in ADDRESSES.items() if addr == client.address)


def test_a_batch_over_several_owners_answers_every_key_in_place(make_client):
    cmap = make_map(1, {"a": ACTIVE, "b": ACTIVE, "c": ACTIVE})
    cluster = make_client(cmap)
    seen: dict = {}
    lock = threading.Lock()

    def part(client, idx):
        with lock:
            seen[node_of(client)] = list(idx)
        return [KEYS[i] for i in idx]

    assert cluster._batch(KEYS, None, part, read=True).values == KEYS
    owners = Placement(cmap).write.owners(KEYS)
    assert seen == {nid: [i for i, o in enumerate(owners) if o == nid] for nid in "abc"}


def test_one_owner_gets_the_whole_batch_in_order(make_client):
    cluster = make_client(make_map(1, {"a": ACTIVE}))
    got = []

    def part(client, idx):
        got.append(list(idx))
        return [KEYS[i] for i in idx]

    assert cluster._batch(KEYS, None, part).values == KEYS
    assert got == [list(range(len(KEYS)))]
    assert cluster._batch(KEYS[:1], None, part).values == KEYS[:1]


def test_stale_parts_retry_by_the_new_owners_and_keep_their_positions(make_client):
    # Every old owner refuses; the new map gives every key to "d": the retried
    # keys (gathered from three parts) must still line up with their answers.
    old = make_map(1, {"a": ACTIVE, "b": ACTIVE, "c": ACTIVE})
    new = make_map(2, {"d": ACTIVE})
    cluster = make_client(old)
    calls = []

    def part(client, idx):
        calls.append((node_of(client), client.epoch, len(idx)))
        if client.epoch < 2:
            raise errors.StaleEpochError("newer map", 2, msgpack.packb(new.to_dict()))
        return [b"from-" + KEYS[i] for i in idx]

    values = cluster._batch(KEYS, None, part).values
    assert values == [b"from-" + k for k in KEYS]
    assert sorted(c[0] for c in calls if c[1] == 1) == ["a", "b", "c"]
    assert [c for c in calls if c[1] == 2] == [("d", 2, len(KEYS))]
    assert cluster.client_stats()["stale_epoch_retries"] == 1


def test_misses_at_the_owner_are_read_from_the_previous_owner_while_a_node_joins(make_client):
    cmap = make_map(3, {"a": ACTIVE, "b": ACTIVE, "c": ACTIVE, "d": JOINING})
    placement = Placement(cmap)
    cluster = make_client(cmap)

    def part(client, idx):  # the joining node has nothing yet; the others have everything
        return [None if node_of(client) == "d" else KEYS[i] for i in idx]

    values = cluster._batch(KEYS, None, part, read=True).values
    assert values == KEYS  # every key the joiner owns was found at its previous owner
    moved = sum(placement.owner(k) == "d" for k in KEYS)
    assert moved > 0
    assert cluster.client_stats()["fallback_reads"] == moved
    assert cluster.client_stats()["fallback_hits"] == moved
