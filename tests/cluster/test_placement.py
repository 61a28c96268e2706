"""Placement from the cluster map: ketama-compatible owners, bounded remapping, the dual-read fallback.

Deterministic: the keys are fixed sha256 page hashes, so every count below is
the same on every run.
"""

from __future__ import annotations

import hashlib

import pytest
from uhashring import HashRing

from gcache.cluster.cluster_map import ACTIVE, DEAD, DRAINING, JOINING, ClusterMap
from gcache.cluster.placement import VNODES, Placement, Ring
from gcache.wire.keys import KeyBuilder

KEY_COUNT = 20_000
BUILDER = KeyBuilder(model="Qwen/Qwen3-8B")


def page_keys(count: int, salt: str = "") -> list[bytes]:
    """Store keys of content-addressed pages (sha256 hex, as SGLang HiCache names them)."""
    return [BUILDER.key(hashlib.sha256(f"{salt}page-{i}".encode()).hexdigest()) for i in range(count)]


KEYS = page_keys(KEY_COUNT)


def node_id(i: int) -> str:
    return f"gpu-node-{i:02d}"


def cluster_map(states: dict[str, str], weights: dict[str, int] | None = None) -> ClusterMap:
    weights = weights or {}
    return ClusterMap.from_dict(
        {
            "epoch": 7,
            "nodes": [
                {"id": nid, "address": f"10.0.0.{i + 1}:7600", "weight": weights.get(nid, 1088), "state": st}
                for i, (nid, st) in enumerate(sorted(states.items()))
            ],
        }
    )


def active(count: int) -> dict[str, str]:
    return {node_id(i): ACTIVE for i in range(count)}


@pytest.mark.parametrize(
    "weights",
    [
        {"a": 1, "b": 1, "c": 1},
        {"gpu-node-00": 1088, "gpu-node-01": 2176, "gpu-node-02": 1088, "gpu-node-03": 544},
        {"10.0.0.1:7600": 1, "10.0.0.2:7600": 5},
    ],
)
def test_owner_matches_uhashring_for_ascii_keys(weights):
    ring = Ring(weights)
    reference = HashRing(nodes={n: {"weight": w, "vnodes": VNODES} for n, w in weights.items()}, hash_fn="ketama")
    keys = KEYS[:3000] + [b"a", b"k1", b"x" * 512, b"ns/abc.full_m_0_1"]
    for key in keys:
        assert ring.owner(key) == reference.get_node(key.decode()), key


def test_vnodes_as_documented():
    assert VNODES == 160  # docs/cluster.md: 160 virtual nodes x 4 points per node at equal weights


def moved(before: list, after: list) -> list[int]:
    return [i for i, (b, a) in enumerate(zip(before, after)) if b != a]


@pytest.mark.parametrize("count", [3, 5, 8])
def test_join_moves_at_most_1_25_over_n_and_only_to_the_new_node(count):
    # "adding or removing one of N nodes moves about 1/N of the keys, at most 1.25/N"
    before = Placement(cluster_map(active(count))).write.owners(KEYS)
    newcomer = node_id(count)
    joined = Placement(cluster_map({**active(count), newcomer: JOINING}))
    after = joined.write.owners(KEYS)
    moves = moved(before, after)
    assert 0 < len(moves) <= 1.25 / count * KEY_COUNT
    assert {after[i] for i in moves} == {newcomer}
    # During the join, a miss at the new owner is read from the old one.
    for i in moves:
        assert joined.fallback(KEYS[i], after[i]) == before[i]


@pytest.mark.parametrize("count", [3, 5, 8])
def test_leave_moves_at_most_1_25_over_n_and_only_the_leaving_nodes_keys(count):
    before = Placement(cluster_map(active(count))).write.owners(KEYS)
    for i in range(count):
        leaving = node_id(i)
        drained = Placement(cluster_map({**active(count), leaving: DRAINING}))
        after = drained.write.owners(KEYS)
        moves = moved(before, after)
        assert 0 < len(moves) <= 1.25 / count * KEY_COUNT, leaving
        assert {before[k] for k in moves} == {leaving}
        assert leaving not in after
        # The leaving node owned exactly the keys that moved.
        assert len(moves) == before.count(leaving)
        # Gone for good (removed from the map): the same owners as while draining.
        gone = {n: ACTIVE for n in active(count) if n != leaving}
        assert Placement(cluster_map(gone)).write.owners(KEYS) == after


def test_equal_weights_balance():
    owners = Ring({node_id(i): 1 for i in range(8)}).owners(KEYS)
    shares = [owners.count(node_id(i)) / KEY_COUNT for i in range(8)]
    assert max(shares) <= 1.2 / 8 and min(shares) >= 0.8 / 8


def test_weight_two_gets_about_twice_the_keys():
    weights = {"small-a": 1088, "big": 2176, "small-b": 1088}
    owners = Placement(cluster_map({n: ACTIVE for n in weights}, weights)).write.owners(KEYS)
    small = (owners.count("small-a") + owners.count("small-b")) / 2
    assert 1.6 <= owners.count("big") / small <= 2.5


def test_fallback_is_none_when_nothing_migrates():
    states = {**active(4), "gpu-node-09": DEAD}  # a dead node is no migration
    placement = Placement(cluster_map(states))
    assert not placement.migrating
    for key in KEYS[:2000]:
        owner = placement.owner(key)
        assert owner != "gpu-node-09"
        assert placement.fallback(key, owner) is None


def test_fallback_while_a_node_joins_is_the_previous_owner():
    placement = Placement(cluster_map({**active(4), "new": JOINING}))
    previous = Ring({node_id(i): 1088 for i in range(4)})
    seen_new = 0
    for key in KEYS[:4000]:
        owner = placement.owner(key)
        if owner == "new":
            seen_new += 1
            assert placement.fallback(key, owner) == previous.owner(key) != "new"
        else:
            assert owner == previous.owner(key)
            assert placement.fallback(key, owner) is None
    assert seen_new > 0


def test_fallback_while_a_node_drains_is_the_draining_node():
    placement = Placement(cluster_map({**active(4), node_id(1): DRAINING}))
    before = Ring({node_id(i): 1088 for i in range(4)})
    seen_drained = 0
    for key in KEYS[:4000]:
        owner = placement.owner(key)
        assert owner != node_id(1)
        if before.owner(key) == node_id(1):
            seen_drained += 1
            assert placement.fallback(key, owner) == node_id(1)
        else:
            assert owner == before.owner(key)
            assert placement.fallback(key, owner) is None
    assert seen_drained > 0


def test_empty_ring_owns_nothing():
    assert Ring({}).owner(b"k") is None
    assert Ring({}).owners([b"a", b"b"]) == [None, None]
    placement = Placement(ClusterMap.empty())
    assert placement.owner(b"k") is None
    assert placement.fallback(b"k", None) is None
    assert placement.group([b"a", b"b", b"c"]) == {None: [0, 1, 2]}


def test_only_dead_or_draining_nodes_own_no_writes():
    dead_only = Placement(cluster_map({"d": DEAD}))
    assert dead_only.owner(b"k") is None and dead_only.fallback(b"k", None) is None
    # The last node draining owns no writes, but reads can still fall back to it.
    draining_only = Placement(cluster_map({"d": DRAINING}))
    assert draining_only.owner(b"k") is None
    assert draining_only.fallback(b"k", None) == "d"


def test_group_splits_a_batch_by_owner():
    placement = Placement(cluster_map(active(5)))
    keys = KEYS[:1000]
    groups = placement.group(keys)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(len(keys)))
    for owner, idx in groups.items():
        assert all(placement.owner(keys[i]) == owner for i in idx)
