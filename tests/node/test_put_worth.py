"""The PUT_BATCH "worth" field end to end (docs/protocol.md, "Value worth"): a real
gcache-server, the Python client and raw frames. A costly state survives cheap pages of
the same bytes; without the field the order is as before; a malformed field is refused
with BAD_FRAME, stores nothing and leaves the connection usable."""

import tempfile
from pathlib import Path

import pytest

import gcache
from gcache import errors
from gcache._native import xxh64
from gcache.wire.protocol import FrameStatus, Opcode, PutStatus
from gcache.wire.worth import WORTH_VERSION, ValueKind, Worth
from tests.support.raw_protocol import RawConnection

PAGE = 4096
VALUE = bytes(range(256)) * 16
STATE = Worth(ValueKind.STATE_CHECKPOINT, 64 * 1024)  # spares a 64k-token prefix
CHEAP = Worth(ValueKind.ATTENTION_PAGE, 16)  # spares one 16-token block


@pytest.fixture
def small_server(server_factory):
    return server_factory(memory="1MiB", disk="0")  # 256 values of 4 KiB


@pytest.mark.parametrize("transport", ["tcp", "shm"])  # PUT_BATCH, or RESERVE + COMMIT
@pytest.mark.parametrize("with_worth", [True, False])
def test_a_costly_state_outlives_cheap_pages_through_the_server(small_server, with_worth, transport):
    with gcache.Client(small_server.address, transport=transport) as client:
        assert client.put_batch([b"state"], [VALUE], worth=[STATE] if with_worth else None) == [True]
        for i in range(600):  # 2.3 memories of newer pages, one put each
            assert client.put_batch([b"page-%d" % i], [VALUE], worth=[CHEAP] if with_worth else None) == [True]
        assert client.batch_is_exist([b"state"]) == [with_worth]
        gauges = client.stats()["gauges"]
        assert gauges["memory_worth_values"] == (256 if with_worth else 0)
        assert client.ping()["worth"] == WORTH_VERSION


def put_meta(keys, worth) -> dict:
    return {"keys": keys, "lens": [PAGE] * len(keys), "sums": [xxh64(VALUE)] * len(keys), "worth": worth}


@pytest.mark.parametrize(
    "worth, message",
    [
        ({"v": 1, "kind": [2], "cost": [5, 5]}, 'one "kind" and one "cost" per key'),
        ({"v": 1, "kind": [2, 7], "cost": [5, 5]}, "unknown value kind 7"),
        ({"v": 2, "kind": [2, 2], "cost": [5, 5]}, "version 2 is not spoken here"),
        ({"kind": [2, 2], "cost": [5, 5]}, "version 0 is not spoken here"),
        ({"v": 1, "kind": [2, 2], "cost": [5, -1]}, "hold unsigned integers"),
        ({"v": 1, "kind": "state", "cost": [5, 5]}, "must be arrays"),
        ([2, 5], "not a map"),
    ],
)
def test_a_malformed_worth_is_refused_and_changes_nothing(server, worth, message):
    with RawConnection(server.port) as raw:
        keys = [b"a", b"b"]
        frame = raw.request(Opcode.PUT_BATCH, put_meta(keys, worth), VALUE * 2)
        assert frame.status == FrameStatus.BAD_FRAME
        assert message in frame.meta["error"] and "worth" in frame.meta["error"]
        assert raw.exists(keys) == ([False, False], 0)
        assert raw.stats()["counters"]["puts_stored"] == 0
        # The framing held: the same connection stores a well-formed put.
        ok = raw.request(Opcode.PUT_BATCH, put_meta(keys, {"v": 1, "kind": [1, 2], "cost": [16, 4096]}), VALUE * 2)
        assert ok.status == FrameStatus.OK and ok.meta["st"] == [PutStatus.STORED] * 2
        assert raw.get(keys) == [VALUE, VALUE]


def test_the_client_checks_worth_before_sending(server):
    with gcache.Client(server.address) as client:
        with pytest.raises(errors.InvalidArgumentError, match="one per key"):
            client.put_batch([b"a", b"b"], [VALUE] * 2, worth=[STATE])
        with pytest.raises(errors.InvalidArgumentError, match="unknown value kind"):
            client.put_batch([b"a"], [VALUE], worth=[(5, 1)])
        with pytest.raises(errors.InvalidArgumentError, match="cost must be"):
            client.batch_put_from([b"a"], [VALUE], worth=[(1, -3)])
        assert client.batch_is_exist([b"a", b"b"]) == [False, False]


def test_a_malformed_worth_on_reserve_reserves_nothing(server_factory):
    # The one-sided put (RESERVE + COMMIT over shared memory) carries the same field.
    from tests.support.raw_shm import RESERVE, RawShm

    path = tempfile.mkdtemp(prefix="gcw")  # short: a socket path fits 107 bytes
    sock = str(Path(path) / "n.sock")
    node = server_factory(extra_args=["--unix-socket", sock])
    with RawShm(sock) as raw:
        raw.attach()
        bad = raw.request(RESERVE, {"keys": [b"a", b"b"], "lens": [PAGE, PAGE], "worth": {"v": 1, "kind": [2]}})
        assert bad.status == FrameStatus.BAD_FRAME and 'one "kind" and one "cost" per key' in bad.meta["error"]
        good = raw.request(
            RESERVE, {"keys": [b"a", b"b"], "lens": [PAGE, PAGE], "worth": {"v": 1, "kind": [2, 1], "cost": [8, 1]}}
        )
        assert good.status == FrameStatus.OK and good.meta["st"] == [PutStatus.STORED] * 2 and good.meta["res"]
        raw.release(reservations=[good.meta["res"]])
    with gcache.Client(node.address, transport="tcp") as client:
        assert client.batch_is_exist([b"a", b"b"]) == [False, False]
        assert client.stats()["gauges"]["memory_worth_values"] == 0
