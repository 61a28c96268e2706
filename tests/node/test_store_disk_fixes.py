"""Disk tier: an EXISTS answer holds for the GET that follows, memory and disk hold their sum,
and a flush does not hold the store lock (docs/storage.md).

Layout used below: 64 KiB values (one arena block each), a 1 MiB memory tier (16 values),
256 KiB segments (3 records each: a record is the value + 32 B header + key, padded) and a
1 MiB disk tier (5 full segments = 15 records; the 16th record needs the oldest segment
reclaimed). LRU order, so which value leaves memory when is known exactly.
"""

import threading
from pathlib import Path

import pytest

from gcache._native import Store

KIB = 1 << 10
MIB = 1 << 20
VALUE_BYTES = 64 * KIB


def value_of(key: bytes) -> bytes:
    return (key * (VALUE_BYTES // len(key) + 1))[:VALUE_BYTES]


def open_store(data_dir: Path, **kw) -> Store:
    kw.setdefault("eviction_policy", "lru")
    return Store(1 * MIB, 1 * MIB, str(data_dir), segment_bytes=256 * KIB, warm_restart=False, **kw)


def put_all(s: Store, keys) -> None:
    for k in keys:
        assert s.put(k, value_of(k)) == Store.STORED


def segment_ids(data_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in data_dir.glob("seg-*.log"))


def fill_disk_behind(s: Store, first: list[bytes]) -> list[bytes]:
    """Puts `first`, then fillers, until `first` and the oldest fillers fill the disk (15
    records, segment 1 first) and memory holds 16 dirty fillers. Returns the fillers."""
    put_all(s, first)
    fillers = [b"f%02d" % i for i in range(31 - len(first))]
    put_all(s, fillers)
    stats = s.stats()
    assert (stats["keys_memory"], stats["keys_disk"], stats["segments_reclaimed"]) == (16, 15, 0)
    return fillers


def test_a_load_that_forces_a_reclaim_keeps_the_value_it_loads(tmp_path):
    data_dir = tmp_path / "data"
    with open_store(data_dir) as s:
        fillers = fill_disk_behind(s, [b"target"])  # segment 1: target, f00, f01
        assert segment_ids(data_dir) == [1, 2, 3, 4, 5]
        # Reading target needs a memory block: f15 (dirty) is demoted, the disk is full, so
        # segment 1 goes, with target's only record in it, while target is being read.
        assert s.get(b"target") == value_of(b"target")
        stats = s.stats()
        assert stats["segments_reclaimed"] == 1
        assert 1 not in segment_ids(data_dir)
        assert (stats["hits_disk"], stats["misses"]) == (1, 0)
        assert s.get(fillers[0]) is None  # segment 1 really went: its other values with it
        assert s.get(b"target") == value_of(b"target")  # now in memory
        s.check_integrity()


def test_a_chain_reported_present_is_all_there_for_the_get_that_follows(tmp_path):
    data_dir = tmp_path / "data"
    chain = [b"c%d" % i for i in range(5)]
    with open_store(data_dir) as s:
        fill_disk_behind(s, chain)  # segment 1: c0 c1 c2, segment 2: c3 c4 f00
        assert s.exists(chain) == ([True] * 5, 5)
        # Each load demotes a dirty filler and reclaims an old segment, with later links of
        # the chain in it: they were promised to this client, so they move forward.
        for k in chain:
            assert s.get(k) == value_of(k)
        stats = s.stats()
        assert stats["segments_reclaimed"] >= 2
        assert stats["misses"] == 0
        s.check_integrity()


@pytest.mark.parametrize("exclusive", [True, False])
def test_a_value_read_back_from_disk_is_in_one_tier_only(tmp_path, exclusive):
    with open_store(tmp_path / "data", disk_exclusive=exclusive) as s:
        fill_disk_behind(s, [])  # f00..f14 on disk, segments 1..5
        for k in (b"f09", b"f10", b"f11", b"f12"):  # segments 4 and 5: not reclaimed below
            assert s.get(k) == value_of(k)
        s.check_integrity()
        stats = s.stats()
        both_tiers = stats["keys_memory"] + stats["keys_disk"] - stats["keys"]
        assert both_tiers == (0 if exclusive else 4)
        assert stats["disk_copies_dropped"] == (4 if exclusive else 0)


def _read_back_then_push_through(tmp_path, exclusive: bool) -> bool:
    """With memory for 4 values: f14 (newest segment) is read back from disk, then new
    values push it out of memory and, later, its old segment off the disk. Is f14 there?"""
    data_dir = tmp_path / f"data-{exclusive}"
    with Store(
        256 * KIB,
        1 * MIB,
        str(data_dir),
        segment_bytes=256 * KIB,
        warm_restart=False,
        eviction_policy="lru",
        disk_exclusive=exclusive,
    ) as s:
        put_all(s, [b"f%02d" % i for i in range(19)])  # f00..f14 on disk (segments 1..5), 4 in memory
        assert s.get(b"f14") == value_of(b"f14")
        put_all(s, [b"n%02d" % i for i in range(14)])  # f14 leaves memory after 4 of them
        assert 5 not in segment_ids(data_dir)  # f14's old segment went
        s.check_integrity()
        return s.get(b"f14") == value_of(b"f14")


@pytest.mark.parametrize("exclusive, survives", [(True, True), (False, False)])
def test_a_value_read_back_from_disk_outlives_its_old_segment_only_when_exclusive(tmp_path, exclusive, survives):
    # Exclusive: leaving memory again, f09 is written anew at the head of the log.
    # Inclusive: it leaves memory without a write and goes with its old segment.
    assert _read_back_then_push_through(tmp_path, exclusive) is survives


def test_a_value_moved_off_disk_and_then_removed_stays_removed_after_a_crash(tmp_path):
    data_dir = tmp_path / "data"
    s = open_store(data_dir)
    fill_disk_behind(s, [])
    assert s.get(b"f09") == value_of(b"f09")  # to memory; its record is dropped (a tombstone follows)
    assert s.get(b"f10") == value_of(b"f10")
    assert s.remove(b"f09") is True
    s.close()  # no flush: what counts is what the segments say
    with open_store(data_dir) as s:
        assert s.get(b"f09") is None  # its old record did not come back
        assert s.get(b"f10") is None  # memory-only at the crash: lost, as documented
        assert s.get(b"f11") == value_of(b"f11")  # untouched disk values are all there
        put_all(s, [b"again"])
        s.flush()
    with open_store(data_dir) as s:
        assert s.get(b"again") == value_of(b"again")


def test_gets_and_puts_complete_while_a_flush_is_under_way(tmp_path):
    data_dir = tmp_path / "data"
    keys = [b"v%04d" % i for i in range(2000)]
    with Store(64 * MIB, 256 * MIB, str(data_dir), segment_bytes=16 * MIB) as s:
        for k in keys:
            assert s.put(k, k * 512) == Store.STORED  # 2 KiB each, all memory-only
        done_ops = [0]
        stop = threading.Event()

        def reader():
            i = 0
            while not stop.is_set():
                k = keys[i % len(keys)]
                assert s.get(k) == k * 512
                assert s.put(b"new%06d" % i, b"x" * 100) == Store.STORED
                done_ops[0] += 1
                i += 1

        seen = {}

        def progress(done, total):
            if done == 10:  # well inside the flush: 10 of 2000 values written
                start = done_ops[0]
                for _ in range(2000):  # bounded: up to 20 s, only to detect a store lock held
                    if done_ops[0] >= start + 50:
                        break
                    stop.wait(0.01)
                seen["ops"] = done_ops[0] - start
                stats = s.stats()
                seen["written"], seen["total"] = stats["flush_values_written"], stats["flush_values_total"]

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            s.flush(progress)
        finally:
            stop.set()
            thread.join(30)
        assert not thread.is_alive()
        assert seen["ops"] >= 50  # the reader went on while the flush stood at value 10
        assert seen["written"] == 10 and seen["total"] >= len(keys)
        stats = s.stats()
        assert stats["flush_values_written"] == stats["flush_values_total"]
        s.check_integrity()
    with Store(64 * MIB, 256 * MIB, str(data_dir), segment_bytes=16 * MIB) as s:  # every value flushed
        assert all(s.get(k) == k * 512 for k in keys)
        assert s.stats()["hits_memory"] == len(keys)  # warm restart: back in memory


def test_a_failing_progress_callback_ends_the_flush_cleanly(tmp_path):
    with Store(4 * MIB, 16 * MIB, str(tmp_path / "data"), segment_bytes=1 * MIB) as s:
        for i in range(20):
            s.put(b"k%d" % i, b"v" * 1000)

        def progress(done, total):
            if done == 3:
                raise RuntimeError("stop here")

        with pytest.raises(RuntimeError, match="stop here"):
            s.flush(progress)
        s.check_integrity()
        s.remove(b"k0")
        s.flush()  # a later flush works and writes the rest
        s.check_integrity()
        assert s.stats()["flush_values_written"] == 19
