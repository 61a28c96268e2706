"""A data dir written by the release before XXH3 (xxh64 records) opened by this
build: every value comes back exactly, verified by its own checksum, and new
values written beside it are XXH3; corrupt old records are misses, never wrong bytes."""

import shutil

from gcache._native import CHECKSUM_XXH3, CHECKSUM_XXH64, Store, xxh3, xxh64
from tests.support import xxh64_data_dir as old


def open_copy(tmp_path, **kwargs) -> Store:
    data = tmp_path / "data"
    if not data.exists():
        shutil.copytree(old.FIXTURE, data)
    return Store(old.ARENA_BYTES, old.DISK_BYTES, str(data), segment_bytes=old.SEGMENT_BYTES, **kwargs)


def sum_of(store: Store, key: bytes) -> tuple[int, int]:
    """(checksum, kind) of a stored value; the lease object dies here (a live one keeps the store open)."""
    with store.acquire(key) as lease:
        return lease.checksum, lease.checksum_kind


def expected() -> dict[bytes, bytes]:
    values = old.expected_values()
    del values[b"old-key-3"]  # removed before the old release flushed
    return values


def test_warm_restart_on_an_old_data_dir_keeps_every_value(tmp_path):
    with open_copy(tmp_path) as s:  # warm restart: the old warm list loads too
        assert s.stats()["keys_memory"] > 0
        for key, value in expected().items():
            assert s.get(key) == value, key
            assert sum_of(s, key) == (xxh64(value), CHECKSUM_XXH64)
        assert s.get(b"old-key-3") is None
        assert s.stats()["checksum_failures"] == 0
        s.check_integrity()


def test_old_and_new_records_live_side_by_side_across_restarts(tmp_path):
    with open_copy(tmp_path, warm_restart=False) as s:
        for i in range(8):
            assert s.put(b"new-%d" % i, b"n" * (i * 5000)) == Store.STORED
        s.flush()
    for warm in (False, True):
        with open_copy(tmp_path, warm_restart=warm) as s:
            for key, value in expected().items():
                assert s.get(key) == value, key
            for i in range(8):
                value = b"n" * (i * 5000)
                assert s.get(b"new-%d" % i) == value
                assert sum_of(s, b"new-%d" % i) == (xxh3(value), CHECKSUM_XXH3)
            assert s.stats()["checksum_failures"] == 0
            s.check_integrity()
            s.flush()  # a read moves a value to memory (disk_exclusive): flush keeps it for the next round


def test_a_corrupt_old_record_is_a_miss_never_wrong_bytes(tmp_path):
    victim = b"old-key-11"  # 256 KiB: on disk only once the arena filled
    value = old.expected_values()[victim]
    shutil.copytree(old.FIXTURE, tmp_path / "data")
    for seg in sorted((tmp_path / "data").glob("seg-*.log")):
        raw = bytearray(seg.read_bytes())
        at = raw.find(value[:64])
        if at >= 0:
            raw[at + 1000] ^= 0xFF
            seg.write_bytes(raw)
            break
    else:
        raise AssertionError("the fixture lacks the victim's bytes")
    with open_copy(tmp_path, warm_restart=False) as s:
        assert s.get(victim) is None
        assert s.stats()["checksum_failures"] == 1
        for key, v in expected().items():
            if key != victim:
                assert s.get(key) == v, key
        s.check_integrity()
