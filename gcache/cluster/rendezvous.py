"""Weighted rendezvous hashing: the "rendezvous" placement of a cluster map.

A key's owner is the node with the smallest -ln(u) / weight, where u in (0, 1]
comes from a 64-bit mix of the key's ketama point (the first 4 bytes of its
md5, as for the ketama ring) and the node's seed (the first 8 bytes of md5 of
its id). That smallest value is exponentially distributed with rate `weight`,
so a node owns weight / total of the keys, and a change of one node (join,
leave, weight) moves keys only to or from that node: every other node's score
of every key stays what it was. The cost is one score per node per key
(native: gcache._native.rendezvous_slots, about 10 ns each).

Every client, node and master must pick the same owner, so the score uses IEEE
+, -, *, / only (correctly rounded on every platform; the native code is built
without fused multiply-add), in the steps `score` spells out here; ties go to
the node id that sorts first.
"""

from __future__ import annotations

from hashlib import md5

import numpy as np

from gcache._native import ketama_hash, ketama_hashes, rendezvous_slots

_MASK64 = (1 << 64) - 1
LN2 = 0.6931471805599453
SQRT2 = 1.4142135623730951
SERIES_TERMS = 12


def fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finalizer."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK64
    k ^= k >> 33
    return k


def neg_ln_unit(m: int) -> float:
    """-ln(m / 2**53) for an int m in [1, 2**53], the native code's steps exactly."""
    e = m.bit_length() - 1
    f = float(m) / float(1 << e)
    if f > SQRT2:
        f = f / 2.0
        e += 1
    s = (f - 1.0) / (f + 1.0)
    s2 = s * s
    p = 1.0 / float(2 * SERIES_TERMS + 1)
    for k in range(SERIES_TERMS - 1, -1, -1):
        p = p * s2 + 1.0 / float(2 * k + 1)
    ln_m = float(e) * LN2 + 2.0 * s * p
    return 53.0 * LN2 - ln_m


def score(point: int, seed: int, weight: int) -> float:
    """The score of a key (its ketama point) at a node; the smallest score owns the key."""
    x = fmix64(seed ^ fmix64(point))
    return neg_ln_unit((x >> 11) + 1) / float(weight)


def node_seed(node_id: str) -> int:
    return int.from_bytes(md5(node_id.encode()).digest()[:8], "little")


class RendezvousRing:
    """The rendezvous owners over a set of node ids: the interface of placement.Ring."""

    def __init__(self, weights: dict[str, int]):
        self.node_ids = tuple(sorted(weights))
        self._seeds = np.array([node_seed(n) for n in self.node_ids], dtype="=u8").tobytes()
        self._weights = np.array([weights[n] for n in self.node_ids], dtype="=u4").tobytes()

    def __bool__(self) -> bool:
        return bool(self.node_ids)

    def owner(self, key: bytes) -> str | None:
        if not self.node_ids:
            return None
        point = np.array([ketama_hash(key)], dtype=np.uint32)
        return self.node_ids[np.frombuffer(rendezvous_slots(point, self._seeds, self._weights), np.uint32)[0]]

    def slots_of_points(self, points: np.ndarray) -> np.ndarray:
        """Each point's owner as an index into node_ids (there must be a node)."""
        return np.frombuffer(rendezvous_slots(points, self._seeds, self._weights), dtype=np.uint32)

    def owner_slots(self, keys) -> np.ndarray:
        return self.slots_of_points(np.frombuffer(ketama_hashes(keys), dtype="<u4"))

    def owners(self, keys) -> list:
        if not self.node_ids:
            return [None] * len(keys)
        ids = self.node_ids
        return [ids[s] for s in self.owner_slots(keys).tolist()]
