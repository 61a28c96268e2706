"""Checksum kinds on the wire (docs/protocol.md, "Checksums"): XXH3 sums trailing
their values or in the map, xxh64 from peers before XXH3, "cks" only for readers
that ask with "ck"; a sum that does not match stores nothing, whatever its kind."""

from __future__ import annotations

import struct

import pytest

import gcache
from gcache._native import xxh3, xxh64
from tests.support.raw_protocol import (
    BAD_FRAME,
    CHECKSUM_MISMATCH,
    GET_BATCH,
    OK,
    PUT_BATCH,
    STORED,
    RawConnection,
    frame_bytes,
)

XXH64, XXH3 = 0, 1


@pytest.fixture
def node(server_factory):
    return server_factory(extra_args=["--value-bytes-max", "1MiB"])


def trailed_put(c: RawConnection, items, sums=None) -> list[int]:
    """PUT_BATCH with "ck": 1 and "trail": each value followed by its 8-byte XXH3."""
    sums = sums if sums is not None else [xxh3(v) for _, v in items]
    payload = b"".join(v + struct.pack("<Q", s) for (_, v), s in zip(items, sums))
    meta = {"keys": [k for k, _ in items], "lens": [len(v) for _, v in items], "ck": XXH3, "trail": True}
    frame = c.request(PUT_BATCH, meta, payload)
    assert frame.status == OK, frame
    return frame.meta["st"]


def raw_get(c: RawConnection, keys, ck: bool):
    frame = c.request(GET_BATCH, {"keys": keys, "ck": XXH3} if ck else {"keys": keys})
    assert frame.status == OK, frame
    return frame


@pytest.mark.parametrize("size", [0, 1, 300 << 10, 1 << 20])
def test_trailing_xxh3_sums_store_and_read_back(node, size):
    value = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    with RawConnection(node.port) as c:
        assert trailed_put(c, [(b"k", value), (b"k2", b"second")]) == [STORED, STORED]
        frame = raw_get(c, [b"k", b"k2"], ck=True)
        assert frame.meta["cks"] == [XXH3, XXH3]
        assert frame.meta["sums"] == [xxh3(value), xxh3(b"second")]
        assert frame.payload == value + b"second"


def test_a_wrong_trailing_sum_stores_nothing_and_the_stream_stays_in_sync(node):
    good, bad = b"good" * 1000, b"bad!" * 70000  # the bad one spans several landed pieces
    with RawConnection(node.port) as c:
        st = trailed_put(c, [(b"good", good), (b"bad", bad)], sums=[xxh3(good), xxh3(bad) ^ 1])
        assert st == [STORED, CHECKSUM_MISMATCH]
        assert c.get([b"good", b"bad"]) == [good, None]
        # An xxh64 declared as XXH3 is a mismatch too: the kind is part of the sum.
        assert trailed_put(c, [(b"x", b"value")], sums=[xxh64(b"value")]) == [CHECKSUM_MISMATCH]
        assert c.get([b"x"]) == [None]


def test_xxh3_sums_in_the_map_work_too(node):
    with RawConnection(node.port) as c:
        meta = {"keys": [b"a", b"b"], "lens": [3, 3], "sums": [xxh3(b"aaa"), xxh3(b"bbb") ^ 1], "ck": XXH3}
        frame = c.request(PUT_BATCH, meta, b"aaabbb")
        assert frame.meta["st"] == [STORED, CHECKSUM_MISMATCH]
        assert raw_get(c, [b"a"], ck=True).meta["cks"] == [XXH3]


def test_a_reader_without_ck_gets_xxh64_of_every_value(node):
    """A client from before XXH3: its GETs carry no "ck" and it checks xxh64."""
    new, old = b"written as xxh3" * 100, b"written as xxh64"
    with RawConnection(node.port) as c:
        assert trailed_put(c, [(b"new", new)]) == [STORED]
        assert c.put([(b"old", old)]) == [STORED]  # the old client's PUT: xxh64 sums, no "ck"
        frame = raw_get(c, [b"new", b"old", b"miss"], ck=False)
        assert "cks" not in frame.meta
        assert frame.meta["sums"] == [xxh64(new), xxh64(old), 0]
        assert c.get([b"new", b"old"]) == [new, old]  # raw get checks xxh64 itself
        frame = raw_get(c, [b"new", b"old", b"miss"], ck=True)
        assert frame.meta["cks"] == [XXH3, XXH64, 0]
        assert frame.meta["sums"] == [xxh3(new), xxh64(old), 0]


def test_an_unknown_kind_is_a_clear_bad_frame(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(PUT_BATCH, {"keys": [b"k"], "lens": [1], "sums": [0], "ck": 9}, b"v", 7))
        frame = c.recv_frame()
        assert frame.status == BAD_FRAME and "unknown checksum kind" in frame.meta["error"]
        assert c.get([b"k"]) == [None]  # nothing stored, the connection still in sync


def test_ping_names_the_kinds_the_node_speaks(node):
    assert gcache.Client(f"127.0.0.1:{node.port}", transport="tcp").ping()["cks"] == [XXH64, XXH3]


@pytest.mark.parametrize("env", [None, "xxh64"])
def test_the_client_writes_xxh3_unless_told_xxh64(node, monkeypatch, env):
    if env:
        monkeypatch.setenv("GCACHE_CHECKSUM", env)
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="tcp", verify_checksums=True)
    values = [bytes([i]) * (i * 40000) for i in range(6)]
    keys = [b"c%d" % i for i in range(6)]
    assert client.put_batch(keys, values) == [True] * 6
    assert client.get_batch(keys) == values
    with RawConnection(node.port) as c:
        frame = raw_get(c, keys, ck=True)
        assert frame.meta["cks"] == [XXH64 if env else XXH3] * 6


def test_small_values_carry_xxh3_sums_in_the_map(node):
    """Frames of small values: XXH3 sums in the map (no trailing sum per value), checked all the same."""
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="tcp", verify_checksums=True)
    keys = [b"small-%d" % i for i in range(500)]
    values = [bytes([i % 251]) * (i % 97) for i in range(500)]
    assert client.put_batch(keys, values) == [True] * 500
    assert client.get_batch(keys) == values
    with RawConnection(node.port) as c:
        assert raw_get(c, keys[:50], ck=True).meta["cks"] == [XXH3] * 50
        # The node echoes the kind it checked: how a client tells it from a node before XXH3.
        frame = c.request(PUT_BATCH, {"keys": [b"e"], "lens": [1], "sums": [xxh3(b"e")], "ck": XXH3}, b"e")
        assert frame.meta == {"st": [STORED], "ck": XXH3}
