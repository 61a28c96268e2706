"""A peer that trickles a frame slower than the stall timeout allows is cut off.

SO_RCVTIMEO alone only catches a peer that goes fully silent; one that sends
a byte every (stall timeout - epsilon) must still hit the per-frame deadline
(stall timeout + bytes at 1 MiB/s), and its PUT reservation must go back to
the arena.
"""

import select
import socket
import time

import pytest

from tests.support.raw_protocol import PUT_BATCH, RawConnection, frame_bytes

VALUE_BYTES = 1 << 20
POLL_LIMIT_S = 15.0  # bounded polling, not a timing assertion


@pytest.fixture
def node(server_factory):
    return server_factory(extra_args=["--stall-timeout-s", "1"])


def gauges_and_counters(port: int) -> tuple[dict, dict]:
    with RawConnection(port) as c:
        stats = c.stats()
    return stats["gauges"], stats["counters"]


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed (EOF or reset); never blocks."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_trickling_put_is_cut_off_and_its_reservation_freed(node):
    gauges, counters = gauges_and_counters(node.port)
    free_before = gauges["arena_free_bytes"]
    timeouts_before = counters["errors_timeout"]

    # Header + meta announce one 1 MiB value; then the value comes a byte at a time.
    meta = {"keys": [b"slow"], "lens": [VALUE_BYTES], "sums": [0]}
    header_and_meta = frame_bytes(PUT_BATCH, meta, payload_len=VALUE_BYTES)
    with RawConnection(node.port) as slow:
        slow.send(header_and_meta)
        reserved_seen = closed = False
        deadline = time.monotonic() + POLL_LIMIT_S
        while time.monotonic() < deadline:
            try:
                slow.send(b"x")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if closed_by_peer(slow.sock):
                closed = True
                break
            if not reserved_seen:
                reserved_seen = gauges_and_counters(node.port)[0]["arena_free_bytes"] < free_before
            time.sleep(0.5)
        assert reserved_seen, "the PUT should have reserved arena space while its value trickled in"
        assert closed, "a peer trickling 2 B/s must be cut off by the frame deadline"

    # The server closes first, then releases; poll (bounded) for both effects.
    deadline = time.monotonic() + POLL_LIMIT_S
    while time.monotonic() < deadline:
        gauges, counters = gauges_and_counters(node.port)
        if gauges["arena_free_bytes"] == free_before and counters["errors_timeout"] > timeouts_before:
            break
        time.sleep(0.05)
    assert gauges["arena_free_bytes"] == free_before
    assert counters["errors_timeout"] == timeouts_before + 1
    with RawConnection(node.port) as c:
        assert c.exists([b"slow"]) == ([False], 0)
