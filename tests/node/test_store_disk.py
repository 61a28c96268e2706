"""Disk tier: restart rebuilds the index, tombstones, torn tails, corruption, warm restart, dir lock."""

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gcache._native import Store

MIB = 1 << 20
KIB = 1 << 10


def open_store(data_dir: Path, memory=4 * MIB, disk=32 * MIB, **kwargs) -> Store:
    kwargs.setdefault("segment_bytes", 1 * MIB)
    return Store(memory, disk, str(data_dir), **kwargs)


def value_for(i: int, size: int = 40 * KIB) -> bytes:
    return random.Random(i).randbytes(size)


def last_segment(data_dir: Path) -> Path:
    return sorted(data_dir.glob("seg-*.log"))[-1]


def test_restart_after_flush_returns_every_key(tmp_path):
    data = tmp_path / "data"
    s = open_store(data)
    for i in range(300):  # 12 MiB through a 4 MiB arena: most demoted, the rest flushed
        assert s.put(b"k%d" % i, value_for(i)) == Store.STORED
    s.flush()
    s.close()
    with open_store(data, warm_restart=False) as s:
        s.check_integrity()
        for i in range(300):
            assert s.get(b"k%d" % i) == value_for(i)
        s.check_integrity()


def test_restart_without_flush_finds_exactly_what_reached_disk(tmp_path):
    data = tmp_path / "data"
    s = open_store(data)
    for i in range(300):
        s.put(b"k%d" % i, value_for(i))
    on_disk = s.stats()["keys_disk"]
    assert on_disk > 0
    s.close()  # no flush: memory-only values are gone
    with open_store(data) as s:
        assert s.stats()["keys"] == on_disk
        found = 0
        for i in range(300):
            got = s.get(b"k%d" % i)
            assert got is None or got == value_for(i)
            found += got is not None
        assert found == on_disk


@pytest.mark.process
def test_kill_9_loses_nothing_that_reached_disk(tmp_path):
    data = tmp_path / "data"
    child = textwrap.dedent(f"""
        import os, random, signal
        from gcache._native import Store
        s = Store({2 * MIB}, {32 * MIB}, {str(data)!r}, segment_bytes={1 * MIB})
        for i in range(200):
            s.put(b"k%d" % i, random.Random(i).randbytes({40 * KIB}))
        print(s.stats()["keys_disk"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    on_disk = int(proc.stdout.split()[0])
    with open_store(data) as s:
        s.check_integrity()
        found = 0
        for i in range(200):
            got = s.get(b"k%d" % i)
            assert got is None or got == value_for(i)
            found += got is not None
        assert found == on_disk > 0


def test_remove_survives_restart(tmp_path):
    data = tmp_path / "data"
    s = open_store(data)
    s.put(b"gone", b"v" * 1000)
    s.put(b"kept", b"w" * 1000)
    s.flush()
    assert s.remove(b"gone")
    s.close()
    with open_store(data) as s:
        assert s.get(b"gone") is None
        assert s.get(b"kept") == b"w" * 1000


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_torn_tail_is_skipped(tmp_path, damage):
    data = tmp_path / "data"
    s = open_store(data, segment_bytes=64 * MIB)  # one segment, records in put order
    for i in range(10):
        s.put(b"k%d" % i, value_for(i))
    s.flush()
    s.close()
    seg = last_segment(data)
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        if damage == "truncate":
            f.truncate(size - 1000)  # cuts into the last record (k9)
        else:
            f.seek(size)
            f.write(os.urandom(777))
    with open_store(data, warm_restart=False) as s:
        assert s.stats()["torn_records_skipped"] == 1
        s.check_integrity()
        for i in range(9):
            assert s.get(b"k%d" % i) == value_for(i)
        assert s.get(b"k9") == (value_for(9) if damage == "garbage" else None)
        assert s.put(b"after", b"x" * 5000) == Store.STORED
        s.flush()
    with open_store(data, warm_restart=False) as s:
        assert s.stats()["torn_records_skipped"] == 0  # the tail was cut off at the first open
        assert s.get(b"after") == b"x" * 5000
        assert s.get(b"k8") == value_for(8)


def test_corrupted_value_is_a_miss_never_wrong_bytes(tmp_path):
    data = tmp_path / "data"
    s = open_store(data)
    victim, other = value_for(1), value_for(2)
    s.put(b"victim", victim)
    s.put(b"other", other)
    s.flush()
    s.close()
    seg = last_segment(data)
    raw = bytearray(seg.read_bytes())
    at = raw.find(victim[:64]) + 5000
    raw[at] ^= 0xFF
    seg.write_bytes(raw)
    for warm in (True, False):
        with open_store(data, warm_restart=warm) as s:
            assert s.get(b"victim") is None
            assert s.get(b"other") == other
            if warm is True:
                assert s.stats()["checksum_failures"] == 1
                assert not s.contains(b"victim")
            s.check_integrity()
    # The tombstone written at detection keeps it out after a restart.
    with open_store(data) as s:
        assert not s.contains(b"victim")


def test_warm_restart_serves_from_memory(tmp_path):
    data = tmp_path / "data"
    s = open_store(data)
    for i in range(20):
        s.put(b"k%d" % i, value_for(i))
    s.flush()
    s.close()
    assert (data / "warm.list").exists()
    with open_store(data) as s:
        assert s.stats()["keys_memory"] == 20
        for i in range(20):
            assert s.get(b"k%d" % i) == value_for(i)
        stats = s.stats()
        assert stats["hits_memory"] == 20 and stats["hits_disk"] == 0
        s.check_integrity()
    with open_store(data, warm_restart=False) as s:
        assert s.stats()["keys_memory"] == 0


def test_lowering_disk_bytes_reclaims_at_open(tmp_path):
    data = tmp_path / "data"
    with open_store(data, disk=16 * MIB) as s:
        for i in range(300):
            s.put(b"k%d" % i, value_for(i))
        s.flush()
    with open_store(data, disk=4 * MIB) as s:
        assert sum(p.stat().st_size for p in data.glob("seg-*.log")) <= 4 * MIB
        s.check_integrity()
        for i in range(300):
            assert s.get(b"k%d" % i) in (None, value_for(i))


@pytest.mark.process
def test_second_process_cannot_open_the_same_dir(tmp_path):
    data = tmp_path / "data"
    with open_store(data):
        child = f"from gcache._native import Store; Store({1 * MIB}, {1 * MIB}, {str(data)!r})"
        proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert "is in use by another gcache process" in proc.stderr
        with pytest.raises(RuntimeError, match="in use"):
            open_store(data)
    with open_store(data):  # close released the lock
        pass
