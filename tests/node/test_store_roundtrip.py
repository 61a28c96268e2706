"""Store basics: round trips of every size, immutability, refusals that change nothing."""

import os

import pytest

from gcache._native import CHECKSUM_XXH3, CHECKSUM_XXH64, Store, xxh3, xxh64

MIB = 1 << 20
VALUE_MAX = 1 * MIB


@pytest.fixture
def store(tmp_path):
    s = Store(8 * MIB, 32 * MIB, str(tmp_path / "data"), segment_bytes=2 * MIB, value_bytes_max=VALUE_MAX)
    yield s
    s.close()


@pytest.mark.parametrize("size", [0, 1, 4096, 256 * 1024, VALUE_MAX])
def test_round_trip_exact_bytes(store, size):
    value = os.urandom(size)
    assert store.put(b"k", value) == Store.STORED
    assert store.get(b"k") == value
    with store.acquire(b"k") as lease:
        assert lease.length == size
        assert (lease.checksum, lease.checksum_kind) == (xxh3(value), CHECKSUM_XXH3)
        assert bytes(lease.data) == value
        assert lease.data.readonly
    store.check_integrity()


def test_value_max_plus_one_is_too_large_and_stores_nothing(store):
    assert store.put(b"k", bytes(VALUE_MAX + 1)) == Store.TOO_LARGE
    assert not store.contains(b"k")
    assert store.get(b"k") is None
    assert store.stats()["puts_too_large"] == 1
    store.check_integrity()


def test_second_put_is_exists_and_keeps_first_bytes(store):
    assert store.put(b"k", b"first") == Store.STORED
    assert store.put(b"k", b"second value") == Store.EXISTS
    assert store.get(b"k") == b"first"
    assert store.stats()["puts_exists"] == 1
    store.check_integrity()


# The store's limit is the protocol's 512 B plus room for a tenant prefix (33 B).
@pytest.mark.parametrize("key", [b"", b"x" * 546])
def test_invalid_key_is_refused(store, key):
    assert store.put(key, b"v") == Store.KEY_INVALID
    assert store.stats()["keys"] == 0


def test_key_of_512_bytes_is_fine(store):
    key = bytes(range(256)) * 2
    assert store.put(key, b"v") == Store.STORED
    assert store.get(key) == b"v"


@pytest.mark.parametrize("kind, hash_of", [(CHECKSUM_XXH64, xxh64), (CHECKSUM_XXH3, xxh3)])
def test_bad_checksum_is_refused_and_stores_nothing(store, kind, hash_of):
    assert store.put(b"k", b"payload", checksum=hash_of(b"payload") ^ 1, checksum_kind=kind) == Store.CHECKSUM_MISMATCH
    assert not store.contains(b"k")
    stats = store.stats()
    assert stats["checksum_failures_put"] == 1
    assert stats["arena_free_bytes"] == store.arena_bytes
    store.check_integrity()


def test_a_sum_of_the_other_kind_is_refused(store):
    # The kind is part of the sum: an xxh64 declared as XXH3 (or the reverse) never passes.
    assert store.put(b"a", b"payload", checksum=xxh64(b"payload"), checksum_kind=CHECKSUM_XXH3) == 3
    assert store.put(b"b", b"payload", checksum=xxh3(b"payload"), checksum_kind=CHECKSUM_XXH64) == 3
    assert not store.contains(b"a") and not store.contains(b"b")


def test_each_value_keeps_the_kind_it_was_written_with(store):
    assert store.put(b"old", b"v1", checksum=xxh64(b"v1"), checksum_kind=CHECKSUM_XXH64) == Store.STORED
    assert store.put(b"new", b"v2") == Store.STORED
    with store.acquire(b"old") as old, store.acquire(b"new") as new:
        assert (old.checksum, old.checksum_kind) == (xxh64(b"v1"), CHECKSUM_XXH64)
        assert (new.checksum, new.checksum_kind) == (xxh3(b"v2"), CHECKSUM_XXH3)


def test_remove_is_idempotent(store):
    store.put(b"k", b"v")
    assert store.remove(b"k") is True
    assert store.remove(b"k") is False
    assert store.get(b"k") is None
    assert store.put(b"k", b"again") == Store.STORED
    assert store.get(b"k") == b"again"
    store.check_integrity()


def test_miss_counts(store):
    assert store.get(b"nope") is None
    assert store.acquire(b"nope") is None
    assert store.stats()["misses"] == 2


def test_put_accepts_any_contiguous_buffer(store):
    import numpy as np

    array = np.arange(1000, dtype=np.uint32)
    assert store.put(b"np", array) == Store.STORED
    assert store.get(b"np") == array.tobytes()
    assert store.put(b"mv", memoryview(bytearray(b"abc"))) == Store.STORED
    assert store.get(b"mv") == b"abc"


def test_memory_only_store_without_disk(tmp_path):
    with Store(1 * MIB, 0, "") as s:
        values = {b"k%d" % i: os.urandom(100_000) for i in range(30)}
        for k, v in values.items():
            assert s.put(k, v) == Store.STORED
            s.check_integrity()
        for k, v in values.items():
            assert s.get(k) in (None, v)
        assert s.stats()["keys"] <= 10


def test_lease_release_twice_and_data_after_release(store):
    store.put(b"k", b"abc")
    lease = store.acquire(b"k")
    lease.release()
    lease.release()  # idempotent
    with pytest.raises(BufferError):
        lease.data
    store.check_integrity()


def test_close_refuses_while_a_lease_is_alive(tmp_path):
    s = Store(1 * MIB, 0, "")
    s.put(b"k", b"abc")
    lease = s.acquire(b"k")
    with pytest.raises(RuntimeError, match="leases are still held"):
        s.close()
    lease.release()
    del lease
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.get(b"k")
