"""The batch placement path (native ketama_hashes + numpy) gives exactly the
owners of the key-by-key path and of uhashring, for every kind of map.

Deterministic: fixed keys, fixed maps.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import threading

import numpy as np
import pytest
from uhashring import HashRing
from uhashring.ring_ketama import KetamaRing

from gcache import _native
from gcache.cluster.cluster_map import ACTIVE, DEAD, DRAINING, JOINING, ClusterMap
from gcache.cluster.placement import SCALAR_KEYS_MAX, VNODES, Placement, Ring, key_points
from gcache.wire.keys import KeyBuilder

BUILDER = KeyBuilder(model="Qwen/Qwen3-8B")
KEYS = [BUILDER.key(hashlib.sha256(f"native-{i}".encode()).hexdigest()) for i in range(12_000)]
# Short and odd keys too: one md5 block, and lengths around the padding edges.
ODD_KEYS = [b"a", b"k1", b"ns/abc.full_m_0_1"] + [b"x" * n for n in (55, 56, 57, 63, 64, 65, 119, 120, 512)]


def md5_point(key: bytes) -> int:
    return int.from_bytes(hashlib.md5(key).digest()[:4], "little")


def test_ketama_hashes_are_the_first_md5_word_for_every_length():
    keys = [bytes((i * 7 + j) % 256 for j in range(n)) for i, n in enumerate(range(0, 300))]
    keys += ODD_KEYS + ["ключ".encode(), b"\x00\xff" * 40]
    raw = _native.ketama_hashes(keys)
    assert isinstance(raw, bytes) and len(raw) == 4 * len(keys)
    assert [int.from_bytes(raw[4 * i : 4 * i + 4], "little") for i in range(len(keys))] == [md5_point(k) for k in keys]
    assert key_points(keys).tolist() == [md5_point(k) for k in keys]


def test_ketama_hash_of_one_key_is_the_batch_answer():
    keys = KEYS[:200] + ODD_KEYS + [b"\xff" * 3]
    assert [_native.ketama_hash(k) for k in keys] == key_points(keys).tolist()
    with pytest.raises(TypeError, match="must be bytes"):
        _native.ketama_hash("text")


def test_ketama_hashes_match_uhashring_for_ascii_keys():
    ring = KetamaRing()
    keys = KEYS[:500] + ODD_KEYS
    assert key_points(keys).tolist() == [ring.hashi(k.decode(), 0) for k in keys]


def test_ketama_hashes_edges_and_bad_input():
    assert _native.ketama_hashes([]) == b""
    assert _native.ketama_hashes((b"k1",)) == md5_point(b"k1").to_bytes(4, "little")
    with pytest.raises(TypeError, match="must be bytes.*index 1"):
        _native.ketama_hashes([b"ok", "text"])
    with pytest.raises(TypeError):
        _native.ketama_hashes(42)


def test_ketama_hashes_from_many_threads_at_once():
    # The GIL is released while hashing: threads must not disturb each other.
    expected = key_points(KEYS).tolist()
    results: list = [None] * 4

    def work(slot: int) -> None:
        results[slot] = [key_points(KEYS).tolist() for _ in range(3)]

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r == [expected] * 3 for r in results)


def reference_search(points: list[int], needles: list[int]) -> list[int]:
    return [bisect.bisect_right(points, x) % len(points) for x in needles]


@pytest.mark.parametrize("point_count", [1, 2, 3, 7, 640, 2560])
@pytest.mark.parametrize("needle_count", [1, 255, 256, 5000])  # binary search / bucket table
def test_ketama_search_is_bisect_right_wrapping_at_the_end(point_count, needle_count):
    rng = random.Random(point_count * 10_007 + needle_count)
    points = sorted(rng.getrandbits(32) for _ in range(point_count))
    points = sorted(points + points[: point_count // 3])  # equal points, as rings may have
    edges = [0, 2**32 - 1] + [p + d for p in points[:50] for d in (-1, 0, 1) if 0 <= p + d < 2**32]
    needles = (edges + [rng.getrandbits(32) for _ in range(needle_count)])[: max(needle_count, 1)]
    at = _native.ketama_search(np.array(points, dtype=np.uint32), np.array(needles, dtype=np.uint32))
    assert np.frombuffer(at, dtype=np.uint32).tolist() == reference_search(points, needles)


def test_ketama_search_with_points_crowded_into_one_bucket():
    # Many points close together (one bucket of the search table) and equal runs.
    points = sorted([1_000_000 + 3 * i for i in range(300)] + [7] * 20 + [2**32 - 1] * 5)
    needles = sorted({p + d for p in points for d in (-1, 0, 1) if 0 <= p + d < 2**32})
    needles += [0, 5, 2**31]
    at = _native.ketama_search(np.array(points, dtype=np.uint32), np.array(needles, dtype=np.uint32))
    assert np.frombuffer(at, dtype=np.uint32).tolist() == reference_search(points, needles)


def test_ketama_search_takes_hashes_bytes_and_refuses_bad_buffers():
    points = np.array([10, 20, 2**31], dtype=np.uint32)
    needles = np.array([5, 10, 15, 2**31, 2**32 - 1], dtype=np.uint32)
    assert np.frombuffer(_native.ketama_search(points, needles.tobytes()), dtype=np.uint32).tolist() == [0, 1, 1, 0, 0]
    assert _native.ketama_search(points, b"") == b""
    with pytest.raises(ValueError, match="no points"):
        _native.ketama_search(np.array([], dtype=np.uint32), needles)
    with pytest.raises(TypeError, match="uint32"):
        _native.ketama_search(points.astype(np.int64), needles)
    with pytest.raises(ValueError, match="multiple of 4"):
        _native.ketama_search(points, b"abc")
    with pytest.raises(ValueError, match="aligned"):
        _native.ketama_search(points, np.zeros(9, dtype=np.uint8)[1:].view(np.uint32))


WEIGHTS = [
    {"a": 1, "b": 1, "c": 1},
    {"gpu-node-00": 1088, "gpu-node-01": 2176, "gpu-node-02": 1088, "gpu-node-03": 544},
    {"solo": 1},
]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_batch_owners_equal_key_by_key_owners_and_uhashring(weights):
    ring = Ring(weights)
    reference = HashRing(nodes={n: {"weight": w, "vnodes": VNODES} for n, w in weights.items()}, hash_fn="ketama")
    keys = KEYS + ODD_KEYS
    batch = ring.owners(keys)
    assert batch == [ring.owner(k) for k in keys]
    assert batch == [reference.get_node(k.decode()) for k in keys]
    # Small batches take the key-by-key path: the same answers.
    for n in (1, SCALAR_KEYS_MAX, SCALAR_KEYS_MAX + 1):
        assert ring.owners(keys[:n]) == batch[:n]


def test_keys_above_the_last_point_wrap_to_the_first_points_owner():
    ring = Ring(WEIGHTS[1])
    last = max(ring._points)
    above = [k for k in KEYS if md5_point(k) > last]
    assert above, "the fixed keys include some above the last ring point"
    wrapped = ring.owners(above * (SCALAR_KEYS_MAX + 1))  # enough keys for the batch path
    assert set(wrapped) == {ring._owners[0]} == {ring.owner(k) for k in above}


def cluster_map(states: dict[str, str], equal_weights: bool = False) -> ClusterMap:
    return ClusterMap.from_dict(
        {
            "epoch": 3,
            "nodes": [
                {"id": nid, "address": f"10.0.0.{i + 1}:7600", "weight": 1 if equal_weights else 1 + i % 2, "state": st}
                for i, (nid, st) in enumerate(sorted(states.items()))
            ],
        }
    )


MAPS = {
    "active": {"n0": ACTIVE, "n1": ACTIVE, "n2": ACTIVE, "n3": ACTIVE},
    "joining": {"n0": ACTIVE, "n1": ACTIVE, "n2": ACTIVE, "new": JOINING},
    "draining": {"n0": ACTIVE, "n1": DRAINING, "n2": ACTIVE, "n3": ACTIVE},
    "join_and_drain": {"n0": ACTIVE, "n1": DRAINING, "n2": ACTIVE, "new": JOINING, "x": DEAD},
    "single": {"n0": ACTIVE},
    "draining_only": {"n0": DRAINING},
    "dead_only": {"n0": DEAD},
}


def reference_group(placement: Placement, keys, positions) -> dict:
    groups: dict = {}
    for i in positions:
        groups.setdefault(placement.owner(keys[i]), []).append(i)
    return groups


def reference_fallback_group(placement: Placement, keys, positions) -> dict:
    groups: dict = {}
    for i in positions:
        target = placement.fallback(keys[i], placement.owner(keys[i]))
        if target is not None:
            groups.setdefault(target, []).append(i)
    return groups


SUBSETS = {
    "all": None,
    "none": [],
    "one": [17],
    "small": [5, 3, 999, 4, 1, 2000, 7, 8],  # SCALAR_KEYS_MAX keys: key-by-key path
    "just_over": [5, 3, 999, 4, 1, 2000, 7, 8, 11],  # one more: the batch path
    "reversed_evens": list(range(len(KEYS) - 2, -1, -2)),
}


@pytest.mark.parametrize("map_name", MAPS)
@pytest.mark.parametrize("subset", SUBSETS)
def test_group_and_fallback_group_equal_the_key_by_key_answers(map_name, subset):
    placement = Placement(cluster_map(MAPS[map_name]))
    positions = range(len(KEYS)) if SUBSETS[subset] is None else SUBSETS[subset]
    got = placement.group(KEYS, SUBSETS[subset])
    # Same owners, same order of owners (first key seen), same order inside each.
    assert list(got.items()) == list(reference_group(placement, KEYS, positions).items())
    fallback = placement.fallback_group(KEYS, positions)
    assert list(fallback.items()) == list(reference_fallback_group(placement, KEYS, positions).items())


def test_fallback_group_finds_the_moved_keys_while_a_node_joins():
    # Equal weights: a join moves keys only to the new node (see test_placement.py).
    placement = Placement(cluster_map(MAPS["joining"], equal_weights=True))
    groups = placement.fallback_group(KEYS, range(len(KEYS)))
    moved = [i for i, k in enumerate(KEYS) if placement.owner(k) == "new"]
    assert moved and sorted(i for idx in groups.values() for i in idx) == moved
    assert "new" not in groups
