"""Eviction: S3-FIFO keeps a hot set through a scan, leases pin values, capacity holds.

The chain policy (the default) has its own tests in test_eviction_chain.py."""

import os
from pathlib import Path

import pytest

from gcache._native import Store

MIB = 1 << 20
KIB = 1 << 10


def segment_bytes_on_disk(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.glob("seg-*.log"))


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path / "data"


def test_hot_set_survives_a_scan_of_one_off_keys(data_dir):
    with Store(8 * MIB, 64 * MIB, str(data_dir), segment_bytes=4 * MIB, eviction_policy="s3fifo") as s:
        hot = {b"hot%d" % i: os.urandom(64 * KIB) for i in range(16)}  # 1 MiB of 8
        for k, v in hot.items():
            assert s.put(k, v) == Store.STORED
        for _ in range(2):
            for k, v in hot.items():
                assert s.get(k) == v
        for i in range(400):  # 25 MiB of one-off keys, 3x the memory tier
            assert s.put(b"scan%d" % i, os.urandom(64 * KIB)) == Store.STORED
        s.check_integrity()
        before = s.stats()
        assert before["evictions_memory"] > 0
        for k, v in hot.items():
            assert s.get(k) == v
        after = s.stats()
        assert after["hits_memory"] - before["hits_memory"] == len(hot)
        assert after["hits_disk"] == before["hits_disk"]


def test_leased_value_keeps_exact_bytes_through_eviction_and_removal(data_dir):
    with Store(4 * MIB, 16 * MIB, str(data_dir), segment_bytes=1 * MIB) as s:
        value = os.urandom(256 * KIB)
        s.put(b"leased", value)
        lease = s.acquire(b"leased")
        view = lease.data
        for i in range(100):  # 25 MiB through a 4 MiB arena
            s.put(b"filler%d" % i, os.urandom(256 * KIB))
        assert s.remove(b"leased") is True
        for i in range(100, 140):
            s.put(b"filler%d" % i, bytes([i]) * (256 * KIB))
            s.check_integrity()
        assert bytes(view) == value
        assert s.stats()["lease_skips"] > 0
        assert s.get(b"leased") is None
        del view
        lease.release()
        del lease
        s.check_integrity()
        assert s.stats()["leases_active"] == 0


def test_all_memory_leased_gives_no_space_not_a_hang(tmp_path):
    with Store(1 * MIB, 0, "", eviction_attempts_max=64) as s:
        leases = []
        for i in range(4):
            assert s.put(b"k%d" % i, bytes(256 * KIB)) == Store.STORED
            leases.append(s.acquire(b"k%d" % i))
        assert s.put(b"one-more", bytes(256 * KIB)) == Store.NO_SPACE
        assert s.stats()["puts_no_space"] == 1
        s.check_integrity()
        for lease in leases:
            lease.release()
        del leases, lease
        assert s.put(b"one-more", bytes(256 * KIB)) == Store.STORED
        s.check_integrity()


def test_value_bigger_than_memory_is_too_large(tmp_path):
    """A value that can never fit (larger than the arena, no disk) is refused as too large at
    once, not after waiting for space (issue 31, finding 3)."""
    with Store(1 * MIB, 0, "", value_bytes_max=4 * MIB) as s:
        assert s.put(b"big", bytes(2 * MIB)) == Store.TOO_LARGE
        assert not s.contains(b"big")
        s.check_integrity()


def test_memory_and_disk_capacity_never_exceeded(data_dir):
    disk_bytes = 6 * MIB
    with Store(2 * MIB, disk_bytes, str(data_dir), segment_bytes=1 * MIB, value_bytes_max=1 * MIB) as s:
        rng = __import__("random").Random(7)
        for i in range(300):
            size = rng.choice([0, 1, 4 * KIB, 100 * KIB, 300 * KIB, 1 * MIB])
            s.put(b"k%d" % i, os.urandom(size))
            if rng.random() < 0.3:
                s.get(b"k%d" % rng.randrange(i + 1))
            s.check_integrity()
            stats = s.stats()
            assert stats["arena_bytes"] - stats["arena_free_bytes"] <= 2 * MIB
            assert segment_bytes_on_disk(data_dir) <= disk_bytes
            assert stats["disk_used_bytes"] == segment_bytes_on_disk(data_dir)
        stats = s.stats()
        assert stats["segments_reclaimed"] > 0
        assert stats["evictions_disk"] > 0


def test_size_classes_bound_waste(tmp_path):
    # 65 KiB + 1 B lands in the 72 KiB class: waste stays under 12.5%.
    with Store(1 * MIB, 0, "") as s:
        s.put(b"k", bytes(65 * KIB + 1))
        used = s.stats()["arena_bytes"] - s.stats()["arena_free_bytes"]
        assert used == 72 * KIB


def test_disk_reclaim_gives_read_records_a_second_chance(data_dir):
    # Inclusive disk: the read leaves "read"'s record in place (with disk_exclusive the
    # read would move it to memory and drop the record; test_store_disk_fixes.py).
    value = {name: os.urandom(100 * KIB) for name in (b"read", b"unread")}
    s = Store(1 * MIB, 4 * MIB, str(data_dir), segment_bytes=512 * KIB, warm_restart=False, disk_exclusive=False)
    for name, v in value.items():
        s.put(name, v)
    for i in range(12):  # pushes both out of memory into the first segment
        s.put(b"a%d" % i, os.urandom(100 * KIB))
    assert s.get(b"read") == value[b"read"]
    for i in range(50):  # 5 MiB: the first segment is reclaimed, later ones are not
        s.put(b"b%d" % i, os.urandom(100 * KIB))
        s.check_integrity()
    assert s.stats()["segments_reclaimed"] > 0
    s.close()  # no flush: only disk records count
    with Store(1 * MIB, 4 * MIB, str(data_dir), segment_bytes=512 * KIB, warm_restart=False, disk_exclusive=False) as s:
        assert s.get(b"read") == value[b"read"]  # copied forward once
        assert s.get(b"unread") is None  # reclaimed with its segment


def test_large_put_into_an_arena_fragmented_by_small_values(tmp_path):
    # Every other 4 KiB value removed: half the arena is free, in 4 KiB holes.
    with Store(4 * MIB, 0, "", eviction_attempts_max=32) as s:  # FIFO alone frees < 1 MiB in one piece
        for i in range(1024):
            assert s.put(b"small%d" % i, bytes([i % 256]) * 4096) == Store.STORED
        for i in range(0, 1024, 2):
            s.remove(b"small%d" % i)
        lease = s.acquire(b"small1")  # a leased value in the way must be stepped over
        big = os.urandom(1 * MIB)
        assert s.put(b"big", big) == Store.STORED
        s.check_integrity()
        assert s.get(b"big") == big
        assert bytes(lease.data) == bytes([1]) * 4096
        lease.release()
        del lease
        for i in range(1, 1024, 2):
            assert s.get(b"small%d" % i) in (None, bytes([i % 256]) * 4096)
        s.check_integrity()


def test_copy_forwards_are_counted_once_per_read_record(data_dir):
    value = {name: os.urandom(100 * KIB) for name in (b"read", b"unread")}
    with Store(1 * MIB, 4 * MIB, str(data_dir), segment_bytes=512 * KIB, warm_restart=False, disk_exclusive=False) as s:
        for name, v in value.items():
            s.put(name, v)
        for i in range(12):  # pushes both out of memory into the first segment
            s.put(b"a%d" % i, os.urandom(100 * KIB))
        assert s.get(b"read") == value[b"read"]
        assert s.stats()["disk_copy_forwards"] == 0  # nothing reclaimed yet
        for i in range(50):  # reclaims the first segment: "read" moves forward, nothing else was read
            s.put(b"b%d" % i, os.urandom(100 * KIB))
        stats = s.stats()
        assert stats["segments_reclaimed"] > 0
        assert stats["disk_copy_forwards"] == 1
        assert s.get(b"read") == value[b"read"]
        assert s.get(b"unread") is None


def test_ghost_hit_consumes_its_ghost_entry(data_dir):
    # S3-FIFO: a key evicted from the small queue leaves a ghost; re-inserting it
    # goes straight to main and uses the ghost up, so a later re-insert
    # starts in small again instead of skipping it until the ghost ages out.
    with Store(4 * MIB, 64 * MIB, str(data_dir), segment_bytes=4 * MIB, eviction_policy="s3fifo") as s:
        value = os.urandom(128 * KIB)
        keys = [b"once%d" % i for i in range(64)]  # 8 MiB of one-off keys through 4 MiB
        for k in keys:
            assert s.put(k, value) == Store.STORED
        for k in keys[-8:]:  # free 1 MiB so the re-inserts below evict nothing
            assert s.remove(k) is True
        ghosted = keys[0]  # first in, never hit: evicted from small into the ghost
        assert s.remove(ghosted) is True
        before = s.stats()
        assert before["ghost_keys"] > 0

        assert s.put(ghosted, value) == Store.STORED  # ghost hit: straight to main
        hit = s.stats()
        assert hit["evictions_memory"] == before["evictions_memory"]
        assert hit["ghost_keys"] == before["ghost_keys"] - 1
        assert hit["memory_main_queue_bytes"] > before["memory_main_queue_bytes"]
        assert hit["memory_small_queue_bytes"] == before["memory_small_queue_bytes"]
        s.check_integrity()

        assert s.remove(ghosted) is True
        removed = s.stats()
        assert s.put(ghosted, value) == Store.STORED  # the ghost is used up: small again
        again = s.stats()
        assert again["evictions_memory"] == removed["evictions_memory"]
        assert again["ghost_keys"] == removed["ghost_keys"]
        assert again["memory_main_queue_bytes"] == removed["memory_main_queue_bytes"]
        assert again["memory_small_queue_bytes"] > removed["memory_small_queue_bytes"]
        s.check_integrity()
