"""Placement: which node owns a key, computed from the cluster map alone.

The map's `placement` field names how (gcache.cluster.cluster_map.PlacementKind):
"rendezvous" is weighted rendezvous hashing (gcache.cluster.rendezvous: a
change of one node moves keys only to or from it, at any weights); "ketama",
what a map without the field means, is the ring described below. Both give
the same interface (RING_KINDS), and the two rings below are built with it.

A ketama ring (uhashring-compatible: md5, virtual nodes, weights proportional
to capacity) is built once per map; `ketama_points` computes uhashring's points
directly and sorts once (uhashring inserts them one by one, quadratic in the
ring size: seconds for a hundred nodes, on the caller's thread). Two rings matter while a node joins or drains:

  write ring     nodes `joining` or `active`: where keys go, and where reads go first.
  previous ring  nodes `active` or `draining`: the owners before the migration in
                 progress; a read that misses at the write owner falls back here.

A key's point is its md5 exactly as uhashring's ketama hashes an ASCII key
(the first 4 digest bytes, little-endian); its owner is the node of the first
ring point above it, wrapping to the first point. One key: the native
ketama_hash (half the cost of hashlib) + bisect. A batch: the native
ketama_hashes and ketama_search (GIL released; numpy.searchsorted is several
times slower on unsorted keys), and owners stay small ints (indexes into the
ring's node ids) until grouped.
"""

from __future__ import annotations

from bisect import bisect
from hashlib import md5

import numpy as np

from gcache._native import ketama_hash, ketama_hashes, ketama_search
from gcache.cluster.cluster_map import PREVIOUS_STATES, WRITE_STATES, ClusterMap, PlacementKind
from gcache.cluster.rendezvous import RendezvousRing

VNODES = 160  # points per node = VNODES * 4 (ketama replicas) at equal weights
# Up to this many keys a batch is placed key by key: numpy's fixed cost per
# call (a few microseconds per array op) beats the per-key loop only above it.
SCALAR_KEYS_MAX = 8


def key_points(keys) -> np.ndarray:
    """The ketama point (uint32) of every key (bytes) in `keys`."""
    return np.frombuffer(ketama_hashes(keys), dtype="<u4")


def slot_dtype(count: int):
    """The smallest unsigned int type that numbers `count` nodes."""
    return np.uint8 if count <= 1 << 8 else np.uint16 if count <= 1 << 16 else np.uint32


def ketama_points(weights: dict[str, int]) -> dict[int, str]:
    """{point: node id}, exactly uhashring's KetamaRing._ring for these nodes (in this
    dict order) with VNODES virtual nodes each: node n gets
    VNODES * len(weights) * weight // sum(weights) virtual nodes "n-0", "n-1", ...,
    each giving 4 points (the 4 little-endian words of its md5). A point two
    nodes share goes to the later node, as in uhashring."""
    total = sum(weights.values())
    ring: dict[int, str] = {}
    for node_id, weight in weights.items():
        for v in range(VNODES * len(weights) * weight // total):
            digest = md5(f"{node_id}-{v}".encode()).digest()
            for r in range(0, 16, 4):
                ring[int.from_bytes(digest[r : r + 4], "little")] = node_id
    return ring


class Ring:
    """One consistent-hash ring over a set of node ids. Empty rings own nothing."""

    def __init__(self, weights: dict[str, int], points_of=ketama_points):
        self.node_ids = tuple(sorted(weights))
        ring = points_of(weights) if weights else {}
        points = sorted(ring)
        owners = [ring[p] for p in points]
        self._points = points
        self._owners = owners
        self._point_array = np.array(points, dtype=np.uint32)
        slot = {nid: i for i, nid in enumerate(self.node_ids)}
        # Owner of each point as an index into node_ids; small ints sort fastest.
        self._owner_slots = np.array([slot[o] for o in owners], dtype=slot_dtype(len(self.node_ids)))

    def __bool__(self) -> bool:
        return bool(self._points)

    def owner(self, key: bytes) -> str | None:
        if not self._points:
            return None
        i = bisect(self._points, ketama_hash(key))
        return self._owners[i if i < len(self._points) else 0]

    def slots_of_points(self, points: np.ndarray) -> np.ndarray:
        """Each point's owner as an index into node_ids (the ring must not be empty)."""
        at = np.frombuffer(ketama_search(self._point_array, points), dtype=np.uint32)
        return self._owner_slots[at]

    def owner_slots(self, keys) -> np.ndarray:
        """Each key's owner as an index into node_ids (the ring must not be empty)."""
        return self.slots_of_points(key_points(keys))

    def owners(self, keys) -> list:
        if not self._points:
            return [None] * len(keys)
        if len(keys) <= SCALAR_KEYS_MAX:
            return [self.owner(k) for k in keys]
        ids = self.node_ids
        return [ids[s] for s in self.owner_slots(keys).tolist()]


# The ring of each placement kind: node_ids, owner, owners, owner_slots, slots_of_points.
RING_KINDS = {PlacementKind.KETAMA: Ring, PlacementKind.RENDEZVOUS: RendezvousRing}


def _group_slots(slots: np.ndarray, names, positions: list[int] | None, count: int) -> dict:
    """{names[slot]: [positions[j] for each j with slots[j] == slot]}, owners in the
    order of their first key, each list in `positions` order (None: j itself)."""
    counts = np.bincount(slots, minlength=len(names))
    used = np.flatnonzero(counts)
    if len(used) == 1:
        return {names[int(used[0])]: list(range(count)) if positions is None else positions}
    order = np.argsort(slots, kind="stable")  # stable: each owner's keys keep their order
    ends = np.cumsum(counts[used]).tolist()
    starts = [0] + ends[:-1]
    groups = []
    for slot, lo, hi in zip(used.tolist(), starts, ends):
        part = order[lo:hi].tolist()
        first = part[0]
        if positions is not None:
            part = [positions[j] for j in part]
        groups.append((first, names[slot], part))
    groups.sort()  # first appearance, as a key-by-key loop would build the dict
    return {name: idx for _, name, idx in groups}


class Placement:
    """The write ring and the previous ring of one map."""

    def __init__(self, cmap: ClusterMap):
        self.map = cmap
        write = {n.id: n.weight for n in cmap.in_states(WRITE_STATES)}
        previous = {n.id: n.weight for n in cmap.in_states(PREVIOUS_STATES)}
        ring = RING_KINDS[PlacementKind(cmap.placement)]
        self.kind = PlacementKind(cmap.placement)
        self.write = ring(write)
        # Nothing joining or draining: both rings hold the same nodes, build one.
        self.previous = self.write if previous == write else ring(previous)
        self.migrating = cmap.migrating
        # Both rings' owners in one index space (write ids, then previous-only
        # ids), so write and previous owners compare as ints.
        names = list(self.write.node_ids)
        names += [nid for nid in self.previous.node_ids if nid not in self.write.node_ids]
        self._names = tuple(names)
        shared = {nid: i for i, nid in enumerate(names)}
        self._previous_to_shared = np.array(
            [shared[nid] for nid in self.previous.node_ids], dtype=slot_dtype(len(names))
        )

    def owner(self, key: bytes) -> str | None:
        return self.write.owner(key)

    def fallback(self, key: bytes, owner: str | None) -> str | None:
        """Where to read `key` after a miss at `owner`: the previous owner, if it differs."""
        if not self.migrating:
            return None
        prev = self.previous.owner(key)
        return prev if prev != owner else None

    def group(self, keys, indexes=None) -> dict:
        """{owner id or None: [indexes into keys]}; None collects keys no node owns.

        indexes: place only these positions of `keys` (default: all). Owners
        appear in the order of their first key; each list keeps the order of
        `indexes` (so increasing indexes give increasing lists).
        """
        if indexes is None:
            if len(keys) == 1:  # every single-key call
                return {self.write.owner(keys[0]): [0]}
            positions, count = None, len(keys)
        else:
            positions = list(indexes)
            count = len(positions)
        if not count:
            return {}
        if not self.write:
            return {None: list(range(count)) if positions is None else positions}
        if count <= SCALAR_KEYS_MAX:
            groups: dict = {}
            owner = self.write.owner
            for i in range(count) if positions is None else positions:
                groups.setdefault(owner(keys[i]), []).append(i)
            return groups
        subset = keys if positions is None else [keys[i] for i in positions]
        return _group_slots(self.write.owner_slots(subset), self.write.node_ids, positions, count)

    def fallback_group(self, keys, indexes) -> dict:
        """{previous owner id: [indexes]} for the `indexes` of `keys` whose previous
        owner differs from their write owner: group() of the dual read. {} when
        nothing migrates."""
        positions = list(indexes)
        if not self.migrating or not positions or not self.previous:
            return {}
        if len(positions) <= SCALAR_KEYS_MAX:
            groups: dict = {}
            for i in positions:
                key = keys[i]
                target = self.fallback(key, self.owner(key))
                if target is not None:
                    groups.setdefault(target, []).append(i)
            return groups
        points = key_points([keys[i] for i in positions])
        previous = self._previous_to_shared[self.previous.slots_of_points(points)]
        if self.write:
            differs = previous != self.write.slots_of_points(points)  # write slots are shared slots
        else:
            differs = np.ones(len(positions), dtype=bool)
        picked = np.flatnonzero(differs)
        if not len(picked):
            return {}
        kept = [positions[j] for j in picked.tolist()]
        return _group_slots(previous[picked], self._names, kept, len(kept))
