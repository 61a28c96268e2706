"""The client's fast paths (issue 31: the per-call and per-key Python of a GET or PUT, found
by bench/store/profile_paths.py) answer exactly what the general code they shortcut answers:
the same keys, views, slices, request maps, statuses and bytes, and the same errors."""

import socket
import threading

import msgpack
import numpy as np
import pytest

from gcache import errors
from gcache.client import deadline as call_deadline
from gcache.client.api import Client
from gcache.client.buffers import byte_view, slice_view
from gcache.client.connection import READ_BUFFER_BYTES, Connection
from gcache.client.operations import BatchResult, record_put_status, record_put_statuses
from gcache.client.pool import ConnectionPool
from gcache.client.transports.shm_ops import INLINE_BYTES_MAX, LookupOp
from gcache.wire.protocol import KEY_BYTES_MAX, PutStatus, normalize_key, normalize_keys


class _Subclass(str):
    pass


KEYS_OK = [
    b"k",
    "k\u00e9",
    bytearray(b"ba"),
    memoryview(b"mv"),
    b"a" * KEY_BYTES_MAX,
    "s" * KEY_BYTES_MAX,
    _Subclass("x"),
]
KEYS_BAD = [b"", "", b"a" * (KEY_BYTES_MAX + 1), "\u00e9" * 300, 5, None, 1.5]


def test_normalize_keys_matches_normalize_key_per_key():
    assert normalize_keys(KEYS_OK) == [normalize_key(k) for k in KEYS_OK]
    assert all(type(k) is bytes for k in normalize_keys(KEYS_OK))
    for bad in KEYS_BAD:
        with pytest.raises(errors.KeyInvalidError) as general:
            normalize_key(bad)
        with pytest.raises(errors.KeyInvalidError) as fast:
            normalize_keys([b"fine", bad])
        assert str(fast.value) == str(general.value)
    with pytest.raises(errors.KeyInvalidError, match="single key"):
        normalize_keys("abc")


class _Views(Client):
    """Only Client._views (no connection)."""

    def __init__(self):
        super().__init__()

    close = _put_views = _get_views = get_batch = batch_is_exist = batch_exists_prefix = None
    batch_remove = ping = stats = None


_Views.__abstractmethods__ = frozenset()


def _general_views(buf, offsets, sizes, writable):
    base = byte_view(buf, writable)
    return [slice_view(base, o, s, "batch_get_into") for o, s in zip(offsets, sizes)]


@pytest.mark.parametrize(
    "offsets,sizes",
    [
        ([0, 4, 8], [4, 4, 8]),  # the last one ends at the buffer's end
        ([0], [16]),  # the whole buffer
        ([3, 3, 0], [0, 5, 1]),  # empty, overlapping, out of order
    ],
)
def test_one_buffer_views_match_slice_view(offsets, sizes):
    buf = np.arange(16, dtype=np.uint8)
    fast = _Views()._views(len(offsets), buf, sizes, offsets, writable=True, what="batch_get_into")
    general = _general_views(buf, offsets, sizes, True)
    assert [bytes(v) for v in fast] == [bytes(v) for v in general]
    j = next(j for j, size in enumerate(sizes) if size)
    fast[j][:1] = b"\xff"  # the same memory, not a copy
    assert buf[offsets[j]] == 0xFF


@pytest.mark.parametrize(
    "offsets,sizes",
    [([0, 12], [4, 5]), ([-1], [2]), ([0], [-2]), ([True], [2]), ([np.int64(1)], [2]), ([0], [None]), ([1.0], [2])],
)
def test_one_buffer_views_refuse_what_slice_view_refuses(offsets, sizes):
    buf = np.zeros(16, dtype=np.uint8)
    try:
        expected = [bytes(v) for v in _general_views(buf, offsets, sizes, True)]
    except errors.InvalidArgumentError as exc:
        with pytest.raises(errors.InvalidArgumentError) as fast:
            _Views()._views(len(offsets), buf, sizes, offsets, writable=True, what="batch_get_into")
        assert str(fast.value) == str(exc)
    else:  # bools are ints to slice_view: the fast path must agree
        views = _Views()._views(len(offsets), buf, sizes, offsets, writable=True, what="batch_get_into")
        assert [bytes(v) for v in views] == expected


@pytest.mark.parametrize("epoch", [None, 0, 7, 2**40])
@pytest.mark.parametrize("key", [b"k", b"x" * 255, b"y" * 256, b"z" * KEY_BYTES_MAX])
def test_one_key_lookup_map_is_the_dict_msgpack_packs(key, epoch):
    op = LookupOp(BatchResult([key]), 0, 1, None, verify=False)
    meta = {"keys": [key], "inline_max": INLINE_BYTES_MAX, "ck": 1, "vfy": True}
    if epoch is not None:
        meta["epoch"] = epoch
    assert msgpack.unpackb(op.request_meta_bytes(epoch), raw=False) == meta


STATUS_LISTS = [
    [PutStatus.STORED] * 5,
    [0, 1, 0, 1],
    [0, 2, 1],
    [4, 0, 3],
    [],
]


@pytest.mark.parametrize("statuses", STATUS_LISTS)
def test_put_statuses_match_one_by_one(statuses):
    keys = [b"k%d" % i for i in range(len(statuses) + 2)]
    general, fast = BatchResult(keys), BatchResult(keys)
    for i, st in enumerate(statuses, 1):
        record_put_status(general, i, st)
    record_put_statuses(fast, 1, statuses)
    assert fast.values == general.values
    assert (fast.too_large, fast.bad_checksum) == (general.too_large, general.bad_checksum)


@pytest.mark.parametrize("statuses", [[0, 9], [0, [1]], [0, 5]])
def test_put_statuses_refuse_unknown_ones(statuses):
    result = BatchResult([b"a", b"b"])
    with pytest.raises((errors.ProtocolError, errors.KeyInvalidError)):
        record_put_statuses(result, 0, statuses)


# -- bytes read through the buffered and scatter paths stay exact ---------------------


@pytest.mark.process
@pytest.mark.parametrize("buffered", [0, 100, READ_BUFFER_BYTES - 1])
def test_read_into_many_is_byte_exact(buffered):
    """Targets filled partly from the read buffer, partly by the scatter read, with empty
    targets in between: every byte where it belongs."""
    sizes = [0, 7, 0, 40_000, 1, 0, 300_000, 5, 0]
    payload = np.random.default_rng(3).integers(0, 256, buffered + sum(sizes), dtype=np.uint8).tobytes()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def serve():
        conn, _ = listener.accept()
        with conn:
            for i in range(0, len(payload), 4096):
                conn.sendall(payload[i : i + 4096])
            conn.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    conn = Connection(address, timeout_s=5, connect_timeout_s=5)
    try:
        if buffered:
            conn.read_into(memoryview(bytearray(buffered)))  # leaves what else arrived buffered
        out = [bytearray(n) for n in sizes]
        conn.read_into_many([memoryview(b) for b in out])
        assert b"".join(out) == payload[buffered:]
    finally:
        conn.close()
        listener.close()
        thread.join(5)


# -- the pool wakes a waiter, and only then notifies --------------------------------------


class _FakeConn:
    broken = False
    reused = False

    def close(self):
        self.broken = True


def test_pool_hands_a_released_connection_to_a_waiter():
    pool = ConnectionPool(_FakeConn, 1, acquire_timeout_s=5)
    first = pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    while pool._waiting == 0:
        threading.Event().wait(0.001)
    pool.release(first)
    waiter.join(5)
    assert got == [first] and pool._waiting == 0


def test_pool_waiter_times_out_by_the_calls_deadline():
    pool = ConnectionPool(_FakeConn, 1, acquire_timeout_s=5)
    pool.acquire()
    with call_deadline.using(call_deadline.Deadline(0.05)):
        with pytest.raises(errors.PoolExhaustedError):
            pool.acquire()
    assert pool._waiting == 0


def test_deadline_using_nests_and_restores():
    outer, inner = call_deadline.Deadline(5), call_deadline.Deadline(1)
    assert call_deadline.current() is None
    with call_deadline.using(outer) as d:
        assert d is outer and call_deadline.current() is outer
        with call_deadline.using(inner):
            assert call_deadline.current() is inner
        assert call_deadline.current() is outer
        with pytest.raises(RuntimeError):
            with call_deadline.using(inner):
                raise RuntimeError
        assert call_deadline.current() is outer
    assert call_deadline.current() is None
