"""The "rendezvous" placement (issue 21, finding 4): weighted, and a change of one node
moves keys only to or from that node at every weight mix; the map names the placement
so clients, nodes and migration agree (maps without the field stay on ketama)."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from gcache.cluster import rendezvous
from gcache.cluster.cluster_map import (
    ACTIVE,
    DRAINING,
    JOINING,
    PLACEMENT_LEGACY,
    ClusterMap,
    MapError,
    NodeInfo,
    PlacementKind,
)
from gcache.cluster.placement import Placement, Ring
from gcache.cluster.rendezvous import RendezvousRing
from gcache.master.state import MapState
from gcache.server.cluster_agent import _ring_signature

KEYS = [b"page-%d" % i for i in range(40_000)]
# Statistical bounds on 40k keys, deterministic (fixed keys, fixed weights): the issue's
# 1.1x, with the sampling noise of a share this size well inside it.
MOVED_OVER_IDEAL_MAX = 1.1
BALANCE_MAX = 1.1


def weights_mix(seed: int, n: int) -> dict[str, int]:
    rng = random.Random(seed)
    shape = seed % 3
    if shape == 0:  # equal
        return {f"n{i}": 1088 for i in range(n)}
    if shape == 1:  # alternating 1x / 2x
        return {f"n{i}": 1088 * (1 + i % 2) for i in range(n)}
    return {f"n{i}": rng.randint(1, 4096) for i in range(n)}  # anything, small weights too


def make_map(weights: dict[str, int], states=None, placement=PlacementKind.RENDEZVOUS, epoch=1) -> ClusterMap:
    states = states or {}
    nodes = tuple(
        NodeInfo(nid, f"10.0.0.{i + 1}:7600", w, states.get(nid, ACTIVE)) for i, (nid, w) in enumerate(weights.items())
    )
    return ClusterMap(epoch, tuple(sorted(nodes, key=lambda n: n.id)), placement)


def test_native_scores_are_the_python_reference_bit_for_bit():
    rng = random.Random(3)
    weights = {f"node-{i}": rng.randint(1, 1 << 20) for i in range(9)}
    ring = RendezvousRing(weights)
    points = np.array([rng.getrandbits(32) for _ in range(3000)] + [0, 1, 2**32 - 1], dtype=np.uint32)
    native = ring.slots_of_points(points).tolist()
    seeds = [rendezvous.node_seed(n) for n in ring.node_ids]
    for point, slot in zip(points.tolist(), native):
        scores = [rendezvous.score(point, s, weights[n]) for s, n in zip(seeds, ring.node_ids)]
        assert slot == min(range(len(scores)), key=lambda j: (scores[j], j))


def test_owners_are_fixed_forever():
    """Golden owners: a change here would move every key of every rendezvous cluster."""
    ring = RendezvousRing({"a": 1, "b": 2, "c": 3, "d": 4})
    assert "".join(ring.owners([b"k%d" % i for i in range(40)])) == "bdcbcdcaddacdbddcdaccabdcccdbdccddcbbddb"
    assert rendezvous.score(123456789, rendezvous.node_seed("a"), 7) == 0.17576539959835052
    assert [ring.owner(b"k%d" % i) for i in range(4)] == list("bdcb")  # the single-key path agrees


def shares(owners: list, weights: dict) -> float:
    total = sum(weights.values())
    return max(owners.count(n) / len(owners) / (w / total) for n, w in weights.items())


@pytest.mark.parametrize("seed", range(6))
def test_join_leave_reweight_move_only_the_changed_nodes_keys(seed):
    weights = weights_mix(seed, 5 + seed)
    total = sum(weights.values())
    before = Placement(make_map(weights)).write.owners(KEYS)
    assert shares(before, weights) <= BALANCE_MAX
    changes = []
    newcomer = dict(weights, zz=random.Random(seed).randint(1, 4096))
    changes.append(("join", "zz", make_map(newcomer, {"zz": JOINING}), newcomer["zz"] / sum(newcomer.values())))
    for nid, w in weights.items():
        changes.append(("leave", nid, make_map(weights, {nid: DRAINING}), w / total))
        new_w = max(1, w * 2 if seed % 2 else w // 2)
        reweighted = dict(weights, **{nid: new_w})
        ideal = abs(new_w / sum(reweighted.values()) - w / total)
        changes.append(("reweight", nid, make_map(reweighted), ideal))
    for kind, node, cmap, ideal in changes:
        placement = Placement(cmap)
        after = placement.write.owners(KEYS)
        moved = [(k, old, new) for k, old, new in zip(KEYS, before, after) if old != new]
        violations = [m for m in moved if node not in m[1:]]
        assert violations == [], f"{kind} of {node}: {len(violations)} keys moved between other nodes"
        if ideal * len(KEYS) >= 500:  # a share too small to measure a ratio on
            assert len(moved) / len(KEYS) <= MOVED_OVER_IDEAL_MAX * ideal, (kind, node, len(moved), ideal)
        if kind != "reweight":  # the dual read finds every moved key at its previous owner
            assert all(placement.fallback(k, new) == old for k, old, new in moved)


def test_the_map_names_its_placement_and_old_maps_stay_ketama():
    weights = {"a": 3, "b": 1, "c": 2}
    legacy = ClusterMap.from_dict({"epoch": 4, "nodes": [n.to_dict() for n in make_map(weights).nodes]})
    assert legacy.placement == PLACEMENT_LEGACY == PlacementKind.KETAMA
    assert "placement" not in legacy.to_dict()  # the bytes an older reader expects
    assert isinstance(Placement(legacy).write, Ring)
    new = make_map(weights)
    wire = ClusterMap.from_dict(msgpack.unpackb(msgpack.packb(new.to_dict()), raw=False))
    assert wire == new and wire.to_dict()["placement"] == "rendezvous"
    assert isinstance(Placement(wire).write, RendezvousRing)
    assert new.with_node(NodeInfo("d", "10.0.0.9:1", 1, JOINING)).placement == PlacementKind.RENDEZVOUS
    assert new.without_node("a").placement == PlacementKind.RENDEZVOUS
    with pytest.raises(MapError, match="placement 'jump-v9'"):
        ClusterMap.from_dict(dict(new.to_dict(), placement="jump-v9"))
    # Ketama and rendezvous disagree on owners: exactly why one map names one placement.
    assert Placement(legacy).write.owners(KEYS[:200]) != Placement(new).write.owners(KEYS[:200])


def test_a_new_cluster_starts_on_rendezvous_and_a_loaded_map_keeps_its_own():
    fresh = MapState()
    fresh.register("n1", "10.0.0.1:7600", 4)
    assert fresh.map.placement == PlacementKind.RENDEZVOUS
    old_dump = {
        "map": {"epoch": 3, "nodes": [NodeInfo("n1", "10.0.0.1:7600", 4, ACTIVE, 3).to_dict()]},
        "rebalanced": {},
    }
    loaded = MapState.from_dict(old_dump)
    loaded.register("n2", "10.0.0.2:7600", 1)
    assert loaded.map.placement == PlacementKind.KETAMA


def test_the_node_rebalances_when_only_the_placement_changes():
    weights = {"a": 3, "b": 1}
    assert _ring_signature(make_map(weights)) != _ring_signature(make_map(weights, placement=PlacementKind.KETAMA))
