"""Bad input of every kind: an error response (or a clean close where framing
is lost), never a crash or a hang; the server keeps serving fresh connections."""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.raw_protocol import (
    BAD_FRAME,
    BAD_VERSION,
    BUSY,
    GET_BATCH,
    HEADER,
    LIMIT_EXCEEDED,
    OK,
    PING,
    PUT_BATCH,
    STORED,
    UNKNOWN_OPCODE,
    RawConnection,
    frame_bytes,
    put_frame,
)
from tests.support.slots import busy_connection

KNOWN_STATUSES = set(range(8))


@pytest.fixture
def node(server_factory):
    return server_factory(extra_args=["--value-bytes-max", "1MiB", "--stall-timeout-s", "2"])


def wait_connections_open(node, want: int) -> None:
    """Polls the admin /metrics (bounded) until the server counts `want` open connections."""
    line = f"gcache_connections_open {want}"
    for _ in range(200):
        with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/metrics", timeout=10) as r:
            if line in r.read().decode().splitlines():
                return
        time.sleep(0.05)
    raise AssertionError(f"server never reached {line}")


def assert_serving(port: int) -> None:
    """A fresh connection gets correct answers."""
    with RawConnection(port) as c:
        value = os.urandom(333)
        key = os.urandom(16)
        assert c.put([(key, value)]) == [STORED]
        assert c.get([key]) == [value]


def test_bad_magic_is_bad_frame_then_close(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(PING, {}, request_id=5, magic=b"XXXX"))
        frame = c.recv_frame()
        assert frame.status == BAD_FRAME and frame.request_id == 5
        assert "GCH1" in frame.meta["error"] and frame.meta["kind"] == "BAD_FRAME"
        assert c.closed_by_server()
    assert_serving(node.port)


def test_bad_version_is_answered_then_closed(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(PING, {}, request_id=6, version=2))
        frame = c.recv_frame()
        assert frame.status == BAD_VERSION and frame.request_id == 6
        assert c.closed_by_server()
    assert_serving(node.port)


@pytest.mark.parametrize("meta_len,payload_len", [((16 << 20) + 1, 0), (0, (2 << 30) + 1)])
def test_oversized_lengths_are_limit_exceeded_then_closed(node, meta_len, payload_len):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(PUT_BATCH, b"", request_id=7, meta_len=meta_len, payload_len=payload_len))
        frame = c.recv_frame()
        assert frame.status == LIMIT_EXCEEDED and frame.request_id == 7
        assert c.closed_by_server()
    assert_serving(node.port)


def test_unknown_opcode_is_skipped_and_connection_stays_open(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(99, {"x": 1}, b"payload bytes to skip", request_id=8))
        c.send(frame_bytes(PING, {}, request_id=9))
        frame = c.recv_frame()
        assert frame.status == UNKNOWN_OPCODE and frame.request_id == 8
        assert c.recv_frame().request_id == 9


@pytest.mark.parametrize(
    "meta",
    [
        b"\xc1",  # never-used byte
        b"\x93\x01\x02",  # array, not a map; truncated
        b"\x81\xa4keys\xdd\xff\xff\xff\xff",  # claims 4G keys in 10 bytes
        msgpack.packb({"keys": [1, 2]}),  # keys must be bytes
        msgpack.packb({"keys": [b"a"], "lens": [-1], "sums": [0]}),
        msgpack.packb({"keys": [b"a"]}) + b"\x00",  # trailing bytes
        b"\x81" + b"\x91" * 40 + b"\x00",  # nested past the depth bound
    ],
)
def test_malformed_metadata_is_bad_frame_and_connection_stays_open(node, meta):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(GET_BATCH, meta, request_id=10))
        frame = c.recv_frame()
        assert frame.status == BAD_FRAME and frame.request_id == 10
        assert "metadata" in frame.meta["error"] or "keys" in frame.meta["error"]
        assert c.ping()


def test_put_with_inconsistent_lengths_skips_payload_and_stores_nothing(node):
    with RawConnection(node.port) as c:
        meta = {"keys": [b"a", b"b"], "lens": [3, 3], "sums": [0, 0]}
        c.send(frame_bytes(PUT_BATCH, meta, b"12345", request_id=11))  # 5 != 3 + 3
        assert c.recv_frame().status == BAD_FRAME
        meta = {"keys": [b"a", b"b"], "lens": [3], "sums": [0]}
        c.send(frame_bytes(PUT_BATCH, meta, b"123", request_id=12))
        assert c.recv_frame().status == BAD_FRAME
        assert c.get([b"a", b"b"]) == [None, None]


def test_payload_on_a_get_is_bad_frame(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(GET_BATCH, {"keys": [b"a"]}, b"junk", request_id=13))
        assert c.recv_frame().status == BAD_FRAME
        assert c.ping()


def test_client_vanishing_mid_payload_leaks_nothing(node):
    with RawConnection(node.port) as c:
        free_before = c.stats()["gauges"]["arena_free_bytes"]
    value = os.urandom(512 << 10)
    with RawConnection(node.port) as c:
        data = put_frame([(b"half", value)])
        c.send(data[: len(data) - 1000])  # stop mid-value, then disconnect
    with RawConnection(node.port) as c:
        # The server notices the close asynchronously; wait (bounded) until it did.
        for _ in range(200):
            if c.stats()["gauges"]["connections_open"] == 1:
                break
            time.sleep(0.05)
        assert c.exists([b"half"]) == ([False], 0)
        assert c.stats()["gauges"]["arena_free_bytes"] == free_before
        assert c.put([(b"half", value)]) == [STORED]
        assert c.get([b"half"]) == [value]


def test_stalled_frame_is_closed_and_counted(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(PING, {})[:10])  # a third of a header, then silence
        assert c.closed_by_server()  # after --stall-timeout-s 2
    with RawConnection(node.port) as c:
        assert c.stats()["counters"]["errors_timeout"] >= 1


def test_idle_connection_is_closed(server_factory):
    node = server_factory(extra_args=["--idle-timeout-s", "0.5"])
    with RawConnection(node.port) as c:
        assert c.ping()
        assert c.closed_by_server()
    assert_serving(node.port)


def test_connection_limit_answers_busy(server_factory):
    """Every slot held by a connection with a frame under way: a new one is answered BUSY (idle
    ones would be closed to make room instead, tests/wire/test_preauth_budget.py)."""
    node = server_factory(extra_args=["--connections-max", "2"])
    # The fixture's readiness probe is a bare TCP connect the server may not have accepted
    # yet. A PING answered on a later connection proves it was (one accept loop, in order),
    # so once the gauge reads 0 both are gone and the two slots are free.
    with RawConnection(node.port) as probe:
        assert probe.ping()
    wait_connections_open(node, 0)
    first, second = busy_connection(node), busy_connection(node)
    with RawConnection(node.port) as third:
        frame = third.recv_frame()
        assert frame.status == BUSY and "connections-max" in frame.meta["error"]
        assert third.closed_by_server()
    first.close()
    wait_connections_open(node, 1)  # the server has seen the close: a slot is free
    with RawConnection(node.port) as again:
        again.send(frame_bytes(PING, {}, request_id=77))
        frame = again.recv_frame()
        assert frame.request_id == 77 and frame.status == OK
    second.close()


# --- hypothesis: random and half-valid frames -----------------------------------------

_any_msgpack = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.binary(max_size=20)
    | st.text(max_size=10)
    | st.floats(allow_nan=False),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)

_meta_bytes = st.one_of(
    st.binary(max_size=64),
    _any_msgpack.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.fixed_dictionaries(
        {},
        optional={
            "keys": st.lists(st.binary(max_size=8) | st.integers(0, 9), max_size=4),
            "lens": st.lists(st.integers(0, 2**64 - 1), max_size=4),
            "sums": st.lists(st.integers(0, 2**64 - 1), max_size=4),
        },
    ).map(lambda v: msgpack.packb(v, use_bin_type=True)),
)


@st.composite
def _frames(draw):
    kind = draw(st.sampled_from(["random", "header", "header"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    meta = draw(_meta_bytes)
    payload = draw(st.binary(max_size=64))
    header = HEADER.pack(
        draw(st.sampled_from([b"GCH1", b"GCH1", b"GCH2"])),
        draw(st.sampled_from([1, 1, 1, 0, 255])),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 0xFFFF)),
        draw(st.integers(0, 2**64 - 1)),
        draw(st.sampled_from([len(meta), len(meta), 0, 2**32 - 1])),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.sampled_from([len(payload), len(payload), 1 << 40])),
    )
    return header + meta + payload


def _read_responses(sock: socket.socket) -> list[tuple]:
    """Every response until the server closes (we half-closed our side)."""
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    out, offset = [], 0
    while offset < len(data):
        fields = HEADER.unpack_from(data, offset)
        offset += 32 + fields[5] + fields[7]
        assert offset <= len(data), "a response frame was cut short"
        out.append(fields)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_frames())
def test_random_frames_never_hurt_the_server(node, data):
    with socket.create_connection(("127.0.0.1", node.port), timeout=20) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)  # truncated frames end in EOF: a clean close
        for magic, version, _op, flags, _rid, _ml, status, _pl in _read_responses(sock):
            assert magic == b"GCH1" and version == 1 and flags & 1
            assert status in KNOWN_STATUSES
    assert node.alive()
    with RawConnection(node.port) as c:
        assert c.ping()


def test_server_survived_everything_and_counted_errors(node):
    with RawConnection(node.port) as c:
        c.send(frame_bytes(PING, {}, magic=b"NOPE"))
        c.recv_frame()
    with RawConnection(node.port) as c:
        c.send(frame_bytes(42, {}))
        c.recv_frame()
        counters = c.stats()["counters"]
    assert counters["errors_bad_frame"] >= 1 and counters["errors_unknown_opcode"] >= 1
    assert_serving(node.port)
