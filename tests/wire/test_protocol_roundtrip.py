"""Every opcode of docs/protocol.md against a real gcache-server, raw over a socket."""

from __future__ import annotations

import os

import pytest

from tests.support.raw_protocol import (
    CHECKSUM_MISMATCH,
    EXISTS,
    GET_BATCH,
    KEY_INVALID,
    LIMIT_EXCEEDED,
    OK,
    PING,
    PUT_BATCH,
    REMOVE_BATCH,
    STORED,
    VALUE_TOO_LARGE,
    RawConnection,
    frame_bytes,
    put_frame,
)

VALUE_MAX = 1 << 20  # --value-bytes-max in these tests


@pytest.fixture
def node(server_factory):
    return server_factory(extra_args=["--value-bytes-max", "1MiB", "--batch-keys-max", "64"])


@pytest.mark.parametrize("size", [0, 1, 4096, 256 << 10, VALUE_MAX])
def test_put_get_round_trip_exact_bytes(node, size):
    value = os.urandom(size)
    with RawConnection(node.port) as c:
        assert c.put([(b"k", value)]) == [STORED]
        assert c.get([b"k"]) == [value]
        assert c.put([(b"k", os.urandom(size))]) == [EXISTS]  # immutable: the first value stays
        assert c.get([b"k"]) == [value]


def test_value_over_max_is_refused_and_connection_stays_usable(node):
    with RawConnection(node.port) as c:
        big, small = os.urandom(VALUE_MAX + 1), b"after"
        assert c.put([(b"big", big), (b"small", small)]) == [VALUE_TOO_LARGE, STORED]
        assert c.get([b"big", b"small"]) == [None, small]


def test_batch_mixes_hits_and_misses_in_key_order(node):
    items = [(f"key-{i}".encode(), os.urandom(i * 100)) for i in range(20)]
    with RawConnection(node.port) as c:
        assert c.put(items[::2]) == [STORED] * 10
        got = c.get([k for k, _ in items])
        assert got == [v if i % 2 == 0 else None for i, (_, v) in enumerate(items)]


def test_str_keys_are_the_same_keys_as_bin(node):
    with RawConnection(node.port) as c:
        assert c.put([(b"abc", b"v")]) == [STORED]
        frame = c.request(GET_BATCH, {"keys": ["abc"]})
        assert frame.meta["lens"] == [1] and frame.payload == b"v"


def test_checksum_mismatch_stores_nothing(node):
    with RawConnection(node.port) as c:
        assert c.put([(b"k", b"value")], sums=[12345]) == [CHECKSUM_MISMATCH]
        assert c.get([b"k"]) == [None]
        assert c.put([(b"k", b"value")]) == [STORED]


def test_key_length_limits(node):
    with RawConnection(node.port) as c:
        assert c.put([(b"", b"x"), (b"a" * 513, b"y"), (b"b" * 512, b"z")]) == [KEY_INVALID, KEY_INVALID, STORED]
        assert c.get([b"b" * 512]) == [b"z"]


def test_exists_and_prefix(node):
    with RawConnection(node.port) as c:
        c.put([(b"a", b"1"), (b"b", b"2"), (b"d", b"4")])
        assert c.exists([b"a", b"b", b"c", b"d"]) == ([True, True, False, True], 2)
        assert c.exists([b"c", b"a"]) == ([False, True], 0)
        assert c.exists([]) == ([], 0)


def test_remove_is_idempotent(node):
    with RawConnection(node.port) as c:
        c.put([(b"a", b"1")])
        assert c.remove([b"a", b"zz"]) == [0, 1]
        assert c.remove([b"a"]) == [1]
        assert c.get([b"a"]) == [None]
        assert c.put([(b"a", b"2")]) == [STORED]
        assert c.get([b"a"]) == [b"2"]


def test_ping_and_stats(node):
    with RawConnection(node.port) as c:
        pong = c.ping()
        assert isinstance(pong["version"], str) and pong["epoch"] == 0
        c.request(PING, {"epoch": 7, "unknown": [1, {"x": None}]})  # extra keys are ignored
        stats = c.stats()
        assert set(stats) == {"counters", "gauges", "histograms", "histogram_sums_us"}
        assert stats["counters"]["requests"] >= 2
        assert stats["gauges"]["connections_open"] >= 1
        assert all(len(b) == 32 for b in stats["histograms"].values())
        assert sum(stats["histograms"]["ping"]) >= 2
        assert set(stats["histogram_sums_us"]) == set(stats["histograms"])


def test_counters_move(node):
    with RawConnection(node.port) as c:
        before = c.stats()["counters"]
        c.put([(b"a", b"12345")])
        c.get([b"a", b"missing"])
        after = c.stats()["counters"]
    assert after["puts_stored"] == before["puts_stored"] + 1
    assert after["hits_memory"] + after["hits_disk"] == before["hits_memory"] + before["hits_disk"] + 1
    assert after["misses"] == before["misses"] + 1
    assert after["bytes_in"] == before["bytes_in"] + 5
    assert after["bytes_out"] == before["bytes_out"] + 5


def test_batch_keys_max_is_a_limit_error_and_connection_stays_open(node):
    with RawConnection(node.port) as c:
        keys = [f"k{i}".encode() for i in range(65)]
        frame = c.request(GET_BATCH, {"keys": keys})
        assert frame.status == LIMIT_EXCEEDED and "split the batch" in frame.meta["error"]
        items = [(k, b"v") for k in keys]
        c.send(put_frame(items, request_id=99))
        frame = c.recv_frame()
        assert frame.request_id == 99 and frame.status == LIMIT_EXCEEDED
        assert c.get(keys[:64]) == [None] * 64  # nothing of the refused batch was stored
        assert c.ping()


def test_pipelined_requests_answer_in_order(node):
    values = {f"p{i}".encode(): os.urandom(1000 + i) for i in range(30)}
    stream = bytearray()
    expected = []
    rid = 1000
    for key, value in values.items():
        stream += put_frame([(key, value)], request_id=rid)
        expected.append((rid, PUT_BATCH))
        stream += frame_bytes(GET_BATCH, {"keys": [key]}, request_id=rid + 1)
        expected.append((rid + 1, GET_BATCH))
        stream += frame_bytes(PING, {}, request_id=rid + 2)
        expected.append((rid + 2, PING))
        rid += 3
    with RawConnection(node.port) as c:
        c.send(bytes(stream))  # all at once: the server reads them in order
        got_values = []
        for want_id, want_op in expected:
            frame = c.recv_frame()
            assert (frame.request_id, frame.opcode, frame.status) == (want_id, want_op, OK)
            if want_op == PUT_BATCH:
                assert frame.meta["st"] == [STORED]
            if want_op == GET_BATCH:
                got_values.append(frame.payload)
    assert got_values == list(values.values())


def test_get_response_over_frame_limit_asks_to_split(server_factory):
    node = server_factory(extra_args=["--value-bytes-max", "64KiB", "--frame-payload-bytes-max", "128KiB"])
    with RawConnection(node.port) as c:
        items = [(f"v{i}".encode(), os.urandom(60 << 10)) for i in range(3)]
        assert c.put(items[:2]) == [STORED, STORED]
        assert c.put(items[2:]) == [STORED]
        frame = c.request(GET_BATCH, {"keys": [k for k, _ in items]})
        assert frame.status == LIMIT_EXCEEDED and "split" in frame.meta["error"]
        assert c.get([k for k, _ in items[:2]]) == [v for _, v in items[:2]]  # leases were released
        assert c.remove([k for k, _ in items]) == [0, 0, 0]


def test_remove_then_exists_batch(node):
    with RawConnection(node.port) as c:
        c.put([(b"x", b"1"), (b"y", b"2")])
        frame = c.request(REMOVE_BATCH, {"keys": [b"x"], "epoch": 3})
        assert frame.meta == {"st": [0]}
        assert c.exists([b"x", b"y"]) == ([False, True], 0)
