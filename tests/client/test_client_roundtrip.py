"""Every client method against a real gcache-server (value limit 1 MiB)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcache import Client, errors
from tests.support.servers import ServerProcess

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("client_core")]  # starts processes; both cores

VALUE_BYTES_MAX = 1024 * 1024
SIZES = [0, 1, 4096, 256 * 1024, VALUE_BYTES_MAX]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = ServerProcess(
        tmp_path_factory.mktemp("roundtrip") / "data", extra_args=["--value-bytes-max", str(VALUE_BYTES_MAX)]
    ).start()
    yield server
    server.kill()


@pytest.fixture
def client(node, client_core):
    with Client(node.address, timeout_s=10) as c:
        yield c


@pytest.fixture
def ns(request):
    """A key prefix unique to the test, so tests sharing a server never collide."""
    return request.node.name.encode() + b"/"


def pattern(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", SIZES)
def test_put_get_round_trip(client, ns, size):
    value = pattern(size, size)
    assert client.put(ns + b"k", value) is True
    assert client.get(ns + b"k") == value
    assert client.is_exist(ns + b"k") is True


def test_values_are_immutable_repeated_put_succeeds(client, ns):
    assert client.put(ns + b"k", b"first")
    assert client.put(ns + b"k", b"second") is True
    assert client.get(ns + b"k") == b"first"


def test_value_over_the_limit_is_refused(client, ns):
    with pytest.raises(errors.ValueTooLargeError, match="value-bytes-max") as info:
        client.put(ns + b"big", bytes(VALUE_BYTES_MAX + 1))
    assert info.value.keys == [ns + b"big"]
    assert client.get(ns + b"big") is None


def test_value_over_the_limit_in_a_batch_spares_the_others(client, ns):
    keys = [ns + b"a", ns + b"big", ns + b"c"]
    with pytest.raises(errors.ValueTooLargeError) as info:
        client.put_batch(keys, [b"A", bytes(VALUE_BYTES_MAX + 1), b"C"])
    assert info.value.keys == [ns + b"big"]
    assert client.get_batch(keys) == [b"A", None, b"C"]


def test_miss_is_none_or_false(client, ns):
    assert client.get(ns + b"nothing") is None
    assert client.is_exist(ns + b"nothing") is False
    assert client.get_into(ns + b"nothing", bytearray(8)) is None
    assert client.remove(ns + b"nothing") is False


def test_batches_with_misses_in_the_middle(client, ns):
    keys = [ns + b"%d" % i for i in range(6)]
    values = [pattern(100 * i, i) for i in range(6)]
    stored = [0, 1, 3, 5]
    assert client.put_batch([keys[i] for i in stored], [values[i] for i in stored]) == [True] * 4
    assert client.get_batch(keys) == [values[0], values[1], None, values[3], None, values[5]]
    assert client.batch_is_exist(keys) == [True, True, False, True, False, True]
    assert client.batch_exists_prefix(keys) == 2
    assert client.batch_exists_prefix(keys[2:]) == 0
    assert client.batch_exists_prefix([keys[0], keys[1], keys[3]]) == 3


def test_remove_is_idempotent(client, ns):
    client.put(ns + b"k", b"v")
    assert client.remove(ns + b"k") is True
    assert client.remove(ns + b"k") is False
    assert client.get(ns + b"k") is None
    client.put_batch([ns + b"a", ns + b"b"], [b"1", b"2"])
    assert client.batch_remove([ns + b"a", ns + b"x", ns + b"b"]) == [True, False, True]


def test_str_and_bytes_keys_name_the_same_value(client, ns):
    client.put(ns.decode() + "caf\u00e9", b"v")
    assert client.get(ns + "caf\u00e9".encode()) == b"v"


# -- zero-copy ------------------------------------------------------------------------


def test_numpy_put_from_and_get_into_with_offsets(client, ns):
    src = np.arange(1000, dtype=np.float32)
    assert client.put_from(ns + b"k", src, offset=400, size=2000)  # bytes 400..2399
    dst = np.full(3000, 7, dtype=np.uint8)
    assert client.get_into(ns + b"k", dst, offset=500, size=2100) == 2000
    assert dst[500:2500].tobytes() == src.tobytes()[400:2400]
    assert (dst[:500] == 7).all() and (dst[2500:] == 7).all()
    floats = np.zeros(500, dtype=np.float32)
    assert client.get_into(ns + b"k", floats) == 2000
    assert (floats == np.arange(100, 600, dtype=np.float32)).all()


def test_get_into_bytearray_and_memoryview(client, ns):
    value = pattern(4096, 1)
    client.put(ns + b"k", value)
    ba = bytearray(5000)
    assert client.get_into(ns + b"k", memoryview(ba)[100:]) == 4096
    assert ba[100:4196] == value and ba[:100] == bytes(100) and ba[4196:] == bytes(804)


def test_buffer_too_small_leaves_it_untouched(client, ns):
    client.put(ns + b"k", pattern(300, 2))
    buf = bytearray(b"\xee" * 400)
    with pytest.raises(errors.BufferTooSmallError, match="300 bytes") as info:
        client.get_into(ns + b"k", buf, offset=200, size=100)
    assert info.value.sizes == [300]
    assert buf == bytearray(b"\xee" * 400)
    assert client.get(ns + b"k") == pattern(300, 2)  # the connection is still in sync


def test_batch_get_into_one_buffer_with_offsets(client, ns):
    keys = [ns + b"%d" % i for i in range(5)]
    values = [pattern(1000 + i, i) for i in range(5)]
    client.put_batch([keys[i] for i in (0, 1, 3, 4)], [values[i] for i in (0, 1, 3, 4)])
    pool = np.zeros(5 * 1100, dtype=np.uint8)
    offsets = [i * 1100 for i in range(5)]
    got = client.batch_get_into(keys, pool, sizes=[1100] * 5, offsets=offsets)
    assert got == [1000, 1001, None, 1003, 1004]
    for i in (0, 1, 3, 4):
        assert pool[offsets[i] : offsets[i] + 1000 + i].tobytes() == values[i]
        assert not pool[offsets[i] + 1000 + i : offsets[i] + 1100].any()
    assert not pool[2200:3300].any()


def test_batch_get_into_mixed_buffers(client, ns):
    keys = [ns + b"a", ns + b"b", ns + b"c"]
    values = [pattern(10, 1), pattern(20, 2), pattern(30, 3)]
    client.put_batch(keys, values)
    a, b, c = bytearray(10), np.zeros(32, np.uint8), memoryview(bytearray(40))[5:]
    assert client.batch_get_into(keys, [a, b, c]) == [10, 20, 30]
    assert bytes(a) == values[0] and b[:20].tobytes() == values[1] and bytes(c[:30]) == values[2]


def test_batch_get_into_too_small_spares_the_others(client, ns):
    keys = [ns + b"a", ns + b"b"]
    client.put_batch(keys, [b"x" * 10, b"y" * 10])
    small, fine = bytearray(5), bytearray(10)
    with pytest.raises(errors.BufferTooSmallError) as info:
        client.batch_get_into(keys, [small, fine])
    assert info.value.keys == [ns + b"a"]
    assert small == bytearray(5) and fine == bytearray(b"y" * 10)


def test_batch_put_from_one_buffer(client, ns):
    src = np.frombuffer(pattern(4 * 4096, 9), dtype=np.uint8)
    keys = [ns + b"%d" % i for i in range(4)]
    assert client.batch_put_from(keys, src, sizes=[4096] * 4, offsets=[i * 4096 for i in range(4)]) == [True] * 4
    assert client.get_batch(keys) == [src[i * 4096 : (i + 1) * 4096].tobytes() for i in range(4)]


def test_registered_buffer_with_int_addresses(client, ns):
    arena = np.zeros(64 * 1024, dtype=np.uint8)
    arena[:8192] = np.frombuffer(pattern(8192, 4), dtype=np.uint8)
    assert client.register_buffer(arena.ctypes.data, arena.nbytes) == 0
    base = arena.ctypes.data
    # Mooncake's call shapes: (key, address, size) and (keys, addresses, sizes).
    assert client.put_from(ns + b"one", base + 100, 500) is True
    assert client.batch_put_from([ns + b"a", ns + b"b"], [base, base + 4096], [4096, 4096]) == [True, True]
    assert client.get_into(ns + b"one", base + 20000, 1000) == 500
    assert arena[20000:20500].tobytes() == arena[100:600].tobytes()
    got = client.batch_get_into(
        [ns + b"a", ns + b"b", ns + b"nope"], [base + 30000, base + 40000, base + 50000], [4096, 4096, 4096]
    )
    assert got == [4096, 4096, None]
    assert arena[30000:34096].tobytes() == arena[:4096].tobytes()
    assert arena[40000:44096].tobytes() == arena[4096:8192].tobytes()
    assert client.unregister_buffer(base) == 0
    with pytest.raises(errors.InvalidArgumentError, match="register"):
        client.get_into(ns + b"one", base, 10)


def test_registered_buffer_object(client, ns):
    buf = bytearray(1024)
    client.register_buffer(buf)
    address = np.frombuffer(buf, np.uint8).ctypes.data
    client.put(ns + b"k", b"z" * 100)
    assert client.get_into(ns + b"k", address + 10, 200) == 100
    assert buf[10:110] == b"z" * 100 and buf[:10] == bytes(10)


# -- splitting and pipelining --------------------------------------------------------------


def test_batches_split_into_pipelined_frames(node, ns):
    keys = [ns + b"%d" % i for i in range(50)]
    values = [pattern(3000, i) for i in range(50)]
    with Client(node.address, batch_keys_max=7, frame_payload_bytes_max=10000) as c:
        assert c.put_batch(keys[:40], values[:40]) == [True] * 40
        assert c.get_batch(keys) == values[:40] + [None] * 10
        assert c.batch_is_exist(keys) == [True] * 40 + [False] * 10
        assert c.batch_exists_prefix(keys) == 40
        pool = np.zeros(50 * 3000, np.uint8)
        got = c.batch_get_into(keys, pool, sizes=[3000] * 50, offsets=range(0, 150000, 3000))
        assert got == [3000] * 40 + [None] * 10
        assert pool[:120000].tobytes() == b"".join(values[:40])
        assert c.batch_remove(keys) == [True] * 40 + [False] * 10


def test_checksum_verification_on_get(node, ns):
    with Client(node.address, verify_checksums=True) as c:
        c.put(ns + b"k", pattern(5000, 5))
        assert c.get(ns + b"k") == pattern(5000, 5)
        buf = bytearray(5000)
        assert c.get_into(ns + b"k", buf) == 5000 and bytes(buf) == pattern(5000, 5)


# -- control --------------------------------------------------------------------------------


def test_ping_and_stats(client, ns):
    answer = client.ping()
    assert isinstance(answer["version"], str) and isinstance(answer["epoch"], int)
    client.put(ns + b"k", b"v")
    client.get(ns + b"k")
    stats = client.stats()
    assert set(stats) >= {"counters", "gauges", "histograms"}
    assert all(isinstance(v, int) for v in stats["counters"].values())
    assert all(len(h) == 32 for h in stats["histograms"].values())


def test_large_pipelined_batches_do_not_deadlock(node, ns):
    keys = [ns + b"%d" % i for i in range(64)]
    values = [pattern(64 * 1024, i) for i in range(64)]
    with Client(node.address, batch_keys_max=4, frame_payload_bytes_max=128 * 1024) as c:
        assert c.put_batch(keys, values) == [True] * 64
        assert c.get_batch(keys) == values
        assert c.batch_remove(keys) == [True] * 64


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "exists", "remove", "prefix"]),
            st.lists(st.integers(0, 7), min_size=1, max_size=5),
            st.integers(0, 3000),
        ),
        max_size=12,
    )
)
def test_matches_a_dict_model(node, ops):
    """Random batches of operations behave exactly like a dict of immutable values."""
    with Client(node.address) as c:
        tag = int(np.random.default_rng().integers(1 << 62))  # fresh keys per example
        key = lambda i: b"model-%d-%d" % (tag, i)  # noqa: E731
        model: dict[int, bytes] = {}
        for op, ids, size in ops:
            keys = [key(i) for i in ids]
            if op == "put":
                values = [pattern(size, i) for i in ids]
                assert c.put_batch(keys, values) == [True] * len(ids)
                for i, v in zip(ids, values):
                    model.setdefault(i, v)
            elif op == "get":
                assert c.get_batch(keys) == [model.get(i) for i in ids]
            elif op == "exists":
                assert c.batch_is_exist(keys) == [i in model for i in ids]
            elif op == "prefix":
                expected = next((n for n, i in enumerate(ids) if i not in model), len(ids))
                assert c.batch_exists_prefix(keys) == expected
            else:
                # a batch may name a key twice: only its first removal finds it
                expected, gone = [], set()
                for i in ids:
                    expected.append(i in model and i not in gone)
                    gone.add(i)
                assert c.batch_remove(keys) == expected
                for i in ids:
                    model.pop(i, None)


def test_large_values_without_the_native_scatter_reader(client, ns, monkeypatch):
    """The pure-Python read path (older native module) moves the same bytes."""
    from gcache.client import connection

    monkeypatch.setattr(connection, "_native_recv_into_buffers", None)
    keys = [ns + b"%d" % i for i in range(4)]
    values = [pattern(200 * 1024, i) for i in range(4)]
    client.put_batch(keys, values)
    pool = np.zeros(4 * 200 * 1024, np.uint8)
    assert (
        client.batch_get_into(keys, pool, sizes=[200 * 1024] * 4, offsets=[i * 200 * 1024 for i in range(4)])
        == [200 * 1024] * 4
    )
    assert pool.tobytes() == b"".join(values)
    assert client.get_batch(keys) == values
