"""Machine limits measured in the same run as the stores: memcpy and loopback TCP.

GCache's figures are printed as a fraction of these, so a noisy machine moves
both sides of the ratio together.
"""
from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time

import numpy as np

MEMCPY_BYTES = 256 << 20          # well past any L3 cache
LOOPBACK_BYTES = 512 << 20        # per measurement
LOOPBACK_CHUNK_BYTES = 4 << 20    # one sendall / recv_into at a time
LOOPBACK_TIMEOUT_S = 60.0


def memcpy_gbps(size_bytes: int = MEMCPY_BYTES, rounds: int = 4) -> float:
    """Large-array copy bandwidth (bytes copied per second / 1e9), best of `rounds`."""
    src = np.ones(size_bytes, dtype=np.uint8)
    dst = np.zeros(size_bytes, dtype=np.uint8)   # both touched before timing
    best_s = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(dst, src)
        best_s = min(best_s, time.perf_counter() - start)
    return size_bytes / best_s / 1e9


SENDER_CODE = r"""
import socket, sys
port, total, chunk = map(int, sys.argv[1:4])
payload = memoryview(bytearray(b"\x01" * chunk))
with socket.create_connection(("127.0.0.1", port), timeout=60) as out:
    sent = 0
    while sent < total:
        n = min(chunk, total - sent)
        out.sendall(payload[:n])
        sent += n
"""


def loopback_tcp_gbps(total_bytes: int = LOOPBACK_BYTES, chunk_bytes: int = LOOPBACK_CHUNK_BYTES) -> float:
    """Bandwidth of one TCP stream over 127.0.0.1, from a sender process to this one.

    Two processes, like a client and a store; both sides copy with no Python in
    the loop but a 4 MiB sendall / recv_into, so this is the kernel's loopback
    copy cost, the ceiling for one TCP stream.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(LOOPBACK_TIMEOUT_S)
    sender = subprocess.Popen([sys.executable, "-c", SENDER_CODE, str(listener.getsockname()[1]),
                               str(total_bytes), str(chunk_bytes)])
    sink = memoryview(np.empty(chunk_bytes, dtype=np.uint8))
    received = first_bytes = 0
    elapsed = 0.0
    try:
        conn, _ = listener.accept()
        conn.settimeout(LOOPBACK_TIMEOUT_S)
        with conn:
            n = conn.recv_into(sink, chunk_bytes)     # the clock starts at the first byte
            received += n
            first_bytes = n
            start = time.perf_counter()
            while received < total_bytes and n:
                n = conn.recv_into(sink, chunk_bytes)
                received += n
            elapsed = time.perf_counter() - start
    finally:
        listener.close()
        try:
            sender.wait(LOOPBACK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            sender.kill()
            sender.wait()
    if received != total_bytes or sender.returncode != 0:
        raise RuntimeError(f"loopback measurement failed: {received} of {total_bytes} bytes, "
                           f"sender exit code {sender.returncode}")
    return (total_bytes - first_bytes) / max(elapsed, 1e-9) / 1e9


def measure_limits(repeat: int) -> dict:
    """Runs both probes `repeat` times; medians plus every run."""
    memcpy_runs = [memcpy_gbps() for _ in range(repeat)]
    loopback_runs = [loopback_tcp_gbps() for _ in range(repeat)]
    return {
        "memcpy_gbps": statistics.median(memcpy_runs),
        "loopback_tcp_gbps": statistics.median(loopback_runs),
        "memcpy_gbps_runs": memcpy_runs,
        "loopback_tcp_gbps_runs": loopback_runs,
    }
