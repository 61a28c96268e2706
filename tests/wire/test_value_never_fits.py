"""Issue 31, finding 3 (a): a value that can never be stored is refused VALUE_TOO_LARGE at once.

A value over the node's --value-bytes-max, or larger than its arena, used to take the PUT
reservation budget first: while anything else was reserved it waited the stall timeout (60 s
here) for room it could never use and was then answered NO_SPACE, and a connection already
holding a reservation got NO_SPACE at once. Now every key is checked before any budget is taken,
on RESERVE (shared memory) and PUT_BATCH (TCP) alike. Each call gets a client timeout of 10 s:
the old node did not answer within it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from gcache._native import xxh64
from tests.support.raw_protocol import (
    KEY_INVALID,
    OK,
    STORED,
    VALUE_TOO_LARGE,
    RawConnection,
    put_frame,
)
from tests.support.raw_shm import COMMIT, RESERVE, RawShm
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process

KIB, MIB = 1 << 10, 1 << 20
# A 64 MiB arena (the tests' server), values up to 128 MiB, 4 MiB of reservation budget.
FLAGS = ["--stall-timeout-s", "60", "--value-bytes-max", "128MiB", "--put-reserve-bytes-max", "4MiB"]
OVER_ARENA = 65 * MIB  # under --value-bytes-max: only the arena is too small
ABSURD = 1 << 40  # over both
CLIENT_TIMEOUT_S = 10.0


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="gcs")  # short: a socket path must fit 107 bytes
    yield Path(path)
    for p in Path(path).iterdir():
        p.unlink()
    os.rmdir(path)


def stats(port: int) -> dict:
    with RawConnection(port) as conn:
        return conn.stats()


def test_a_reserve_that_can_never_fit_is_refused_at_once(server_factory, sock_dir):
    sock = str(sock_dir / "node.sock")
    node = server_factory(extra_args=["--unix-socket", sock, *FLAGS])
    with RawShm(sock, CLIENT_TIMEOUT_S) as holder, RawShm(sock, CLIENT_TIMEOUT_S) as asker:
        holder.attach()
        asker.attach()
        held = holder.request(RESERVE, {"keys": [b"held"], "lens": [64 * KIB]})
        assert held.status == OK and held.meta["st"] == [STORED]  # the budget is not empty from here
        # A connection holding nothing would wait for room; the keys that can never fit must not.
        keys = [b"ok", b"over-arena", b"absurd", b""]
        frame = asker.request(RESERVE, {"keys": keys, "lens": [KIB, OVER_ARENA, ABSURD, ABSURD]})
        assert frame.status == OK, frame
        assert frame.meta["st"] == [STORED, VALUE_TOO_LARGE, VALUE_TOO_LARGE, KEY_INVALID]
        value = b"k" * KIB
        off = frame.meta["offs"][0]
        asker.arena[off : off + KIB] = value
        committed = asker.request(COMMIT, {"res": frame.meta["res"], "sums": [xxh64(value), 0, 0, 0]})
        assert committed.status == OK and committed.meta["st"][0] == STORED
        # A connection holding a reservation does not wait: it used to get NO_SPACE.
        again = holder.request(RESERVE, {"keys": [b"absurd-too"], "lens": [ABSURD]})
        assert again.status == OK and again.meta["st"] == [VALUE_TOO_LARGE], again
        assert asker.get([b"ok"]) == [value]
    counters = stats(node.port)["counters"]
    assert counters["puts_too_large"] == 3 and counters["puts_reserve_refused"] == 0


def test_a_put_that_can_never_fit_is_refused_at_once(server_factory):
    node = server_factory(extra_args=FLAGS)
    with RawConnection(node.port, CLIENT_TIMEOUT_S) as holder, RawConnection(node.port, CLIENT_TIMEOUT_S) as putter:
        # A value promised and half sent holds its budget (up to the stall timeout).
        promised = b"h" * (512 * KIB)
        frame = put_frame([(b"held", promised)])
        holder.send(frame[: -len(promised) // 2])
        wait_until(lambda: stats(node.port)["gauges"]["put_reserved_bytes"] > 0, "the promised value's budget")
        putter.send(put_frame([(b"small", b"s"), (b"big", bytes(OVER_ARENA))]))  # the old node stopped reading
        answer = putter.recv_frame()
        assert answer.status == OK and answer.meta["st"] == [STORED, VALUE_TOO_LARGE], answer
        assert putter.get([b"small", b"big"]) == [b"s", None]  # the connection kept its framing
        holder.send(frame[-len(promised) // 2 :])
        assert holder.recv_frame().meta["st"] == [STORED]
    counters = stats(node.port)["counters"]
    assert counters["puts_too_large"] == 1 and counters["puts_reserve_refused"] == 0
