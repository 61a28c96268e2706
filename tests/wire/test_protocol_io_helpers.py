"""gcache._native.send_buffers / recv_into_buffers: the client-side zero-copy socket helpers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from gcache._native import recv_into_buffers, send_buffers


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_scatter_gather_round_trip_exact_bytes(pair):
    a, b = pair
    parts = [os.urandom(n) for n in (0, 1, 4096, 300_000)]
    arr = np.arange(1000, dtype=np.uint32)
    sent = {}

    def sender():
        sent["n"] = send_buffers(a.fileno(), [*parts, memoryview(arr)], 10_000)

    t = threading.Thread(target=sender)
    t.start()
    outs = [bytearray(len(p)) for p in parts]
    out_arr = np.zeros(1000, dtype=np.uint32)
    got = recv_into_buffers(b.fileno(), [*outs, out_arr], 10_000)
    t.join(timeout=30)
    assert got == sent["n"] == sum(map(len, parts)) + arr.nbytes
    assert [bytes(o) for o in outs] == parts
    assert np.array_equal(out_arr, arr)


def test_works_on_a_python_socket_with_a_timeout(pair):
    a, b = pair
    a.settimeout(5)  # non-blocking at the OS level
    b.settimeout(5)
    send_buffers(a.fileno(), [b"hello"], 1000)
    out = bytearray(5)
    recv_into_buffers(b.fileno(), [memoryview(out)], 1000)
    assert out == b"hello"


def test_timeout_raises_timeout_error(pair):
    _, b = pair
    with pytest.raises(TimeoutError, match="timed out"):
        recv_into_buffers(b.fileno(), [bytearray(10)], 50)


def test_peer_close_mid_way_raises_connection_error(pair):
    a, b = pair
    a.sendall(b"abc")
    a.close()
    with pytest.raises(ConnectionError):
        recv_into_buffers(b.fileno(), [bytearray(10)], 5000)


def test_bad_buffers_are_refused_before_any_io(pair):
    a, b = pair
    with pytest.raises(BufferError):
        recv_into_buffers(b.fileno(), [b"read-only bytes"], 100)
    with pytest.raises(ValueError, match="contiguous"):
        send_buffers(a.fileno(), [np.arange(10)[::2]], 100)


@pytest.mark.process
def test_daemon_thread_blocked_in_recv_does_not_abort_interpreter_exit():
    code = (
        "import socket, threading, time\n"
        "from gcache._native import recv_into_buffers\n"
        "a, b = socket.socketpair()\n"
        "threading.Thread(target=recv_into_buffers, args=(b.fileno(), [bytearray(8)], -1), daemon=True).start()\n"
        "time.sleep(0.2)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
