"""Machine limits measured in the same run as the stores: memcpy, loopback TCP and
a Python TCP ping-pong.

GCache's figures are printed as a fraction of these, so a noisy machine moves
both sides of the ratio together.
"""

from __future__ import annotations

import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from gcache.common.processes import stop_process

MEMCPY_BYTES = 256 << 20  # well past any L3 cache
LOOPBACK_BYTES = 512 << 20  # per measurement
LOOPBACK_CHUNK_BYTES = 4 << 20  # one sendall / recv_into at a time
LOOPBACK_TIMEOUT_S = 60.0
MEMCPY_SOURCE_BYTES_MAX = 256 << 20  # batch copies rotate over this much source: past the L3 cache
ARENA_FLOOR_BYTES = 256 << 20  # the store's end of an operation's floor rotates over this much
PINGPONG_ROUNDS = 2000
PINGPONG_REQUEST_BYTES = 32


def memcpy_gbps(size_bytes: int = MEMCPY_BYTES, rounds: int = 4) -> float:
    """Large-array copy bandwidth (bytes copied per second / 1e9), best of `rounds`."""
    src = np.ones(size_bytes, dtype=np.uint8)
    dst = np.zeros(size_bytes, dtype=np.uint8)  # both touched before timing
    best_s = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(dst, src)
        best_s = min(best_s, time.perf_counter() - start)
    return size_bytes / best_s / 1e9


def memcpy_batch_gbps(batch_bytes: int, source_bytes: int = MEMCPY_SOURCE_BYTES_MAX, seconds: float = 0.3) -> float:
    """One thread copying one batch's bytes into one caller-sized buffer, batch after
    batch, from a rotating source larger than the L3 cache: what a one-sided GET of
    that batch must at least do (np.copyto runs on the calling thread only)."""
    return _memcpy_rotating_gbps(batch_bytes, source_bytes, rotate_source=True, seconds=seconds)


def memcpy_put_gbps(batch_bytes: int, destination_bytes: int = MEMCPY_SOURCE_BYTES_MAX, seconds: float = 0.3) -> float:
    """One thread copying one caller-sized batch, batch after batch, into a destination
    rotating over more than the L3 cache: what a one-sided PUT of that batch must at least
    do (a store's arena blocks are not in the cache; the caller's buffer may be)."""
    return _memcpy_rotating_gbps(batch_bytes, destination_bytes, rotate_source=False, seconds=seconds)


def _memcpy_rotating_gbps(batch_bytes: int, rotating_bytes: int, rotate_source: bool, seconds: float) -> float:
    batches = max(2, min(rotating_bytes, 1 << 34) // batch_bytes)
    rotating = np.ones(batches * batch_bytes, dtype=np.uint8)
    fixed = np.full(batch_bytes, 2, dtype=np.uint8)  # both written (paged in) before timing
    copied, elapsed, i = 0, 0.0, 0
    while elapsed < seconds or i < batches:
        at = (i % batches) * batch_bytes
        start = time.perf_counter()
        if rotate_source:
            np.copyto(fixed, rotating[at : at + batch_bytes])
        else:
            np.copyto(rotating[at : at + batch_bytes], fixed)
        elapsed += time.perf_counter() - start
        copied += batch_bytes
        i += 1
    return copied / elapsed / 1e9


PONG_CODE = r"""
import socket, sys
port, request_bytes, reply_bytes = map(int, sys.argv[1:4])
reply = b"\x02" * reply_bytes
with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(request_bytes)
    view = memoryview(buf)
    while True:
        got = 0
        while got < request_bytes:
            n = conn.recv_into(view[got:])
            if n == 0:
                sys.exit(0)
            got += n
        conn.sendall(reply)
"""


def python_tcp_pingpong_p50_us(reply_bytes: int = 4096, rounds: int = PINGPONG_ROUNDS) -> float:
    """p50 round trip of a Python client and a Python echo process over loopback TCP:
    a 32-byte request, a `reply_bytes` reply (the size of a single GET's value)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(LOOPBACK_TIMEOUT_S)
    ponger = subprocess.Popen(
        [sys.executable, "-c", PONG_CODE, str(listener.getsockname()[1]), str(PINGPONG_REQUEST_BYTES), str(reply_bytes)]
    )
    samples = []
    try:
        conn, _ = listener.accept()
        conn.settimeout(LOOPBACK_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = b"\x01" * PINGPONG_REQUEST_BYTES
        reply = memoryview(bytearray(reply_bytes))
        with conn:
            for i in range(rounds + rounds // 10):  # the first tenth warms up
                start = time.perf_counter()
                conn.sendall(request)
                got = 0
                while got < reply_bytes:
                    n = conn.recv_into(reply[got:])
                    if n == 0:
                        raise RuntimeError("ping-pong peer closed the connection")
                    got += n
                if i >= rounds // 10:
                    samples.append(time.perf_counter() - start)
    finally:
        listener.close()
        try:
            ponger.wait(LOOPBACK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            ponger.kill()
            ponger.wait()
    return statistics.median(samples) * 1e6


SENDER_CODE = r"""
import socket, sys
port, total, chunk, buffer_bytes = map(int, sys.argv[1:5])
payload = memoryview(bytearray(b"\x01" * buffer_bytes))
with socket.create_connection(("127.0.0.1", port), timeout=60) as out:
    sent = 0
    while sent < total:
        at = sent % buffer_bytes
        n = min(chunk, total - sent, buffer_bytes - at)
        out.sendall(payload[at:at + n])
        sent += n
"""


def loopback_tcp_gbps(
    total_bytes: int = LOOPBACK_BYTES,
    chunk_bytes: int = LOOPBACK_CHUNK_BYTES,
    buffer_bytes: int | None = None,
    sender_buffer_bytes: int | None = None,
) -> float:
    """Bandwidth of one TCP stream over 127.0.0.1, from a sender process to this one.

    Two processes, like a client and a store; both sides copy with no Python in
    the loop but a 4 MiB sendall / recv_into, so this is the kernel's loopback
    copy cost, the ceiling for one TCP stream. With the default buffer_bytes
    (= chunk_bytes) both ends reuse one cache-resident 4 MiB buffer: the best
    case. buffer_bytes = one batch's bytes makes both ends stream through
    memory the size of a batch, as a store's arena and a caller's buffer do.
    `sender_buffer_bytes` (default: buffer_bytes) sizes the sender's end apart: a store's
    arena (larger than the cache) on one end, a caller's batch on the other.
    """
    buffer_bytes = max(buffer_bytes or chunk_bytes, chunk_bytes)
    sender_buffer_bytes = max(sender_buffer_bytes or buffer_bytes, chunk_bytes)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(LOOPBACK_TIMEOUT_S)
    sender = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SENDER_CODE,
            str(listener.getsockname()[1]),
            str(total_bytes),
            str(chunk_bytes),
            str(sender_buffer_bytes),
        ]
    )
    # numpy's stubs give ndarray the buffer protocol only for Python >= 3.12
    sink = memoryview(np.full(buffer_bytes, 0, dtype=np.uint8))  # type: ignore[arg-type]  # paged in
    received = first_bytes = 0
    elapsed = 0.0
    try:
        conn, _ = listener.accept()
        conn.settimeout(LOOPBACK_TIMEOUT_S)
        with conn:
            n = conn.recv_into(sink, chunk_bytes)  # the clock starts at the first byte
            received += n
            first_bytes = n
            start = time.perf_counter()
            while received < total_bytes and n:
                at = received % buffer_bytes
                n = conn.recv_into(sink[at:], min(chunk_bytes, buffer_bytes - at))
                received += n
            elapsed = time.perf_counter() - start
    finally:
        listener.close()
        try:
            sender.wait(LOOPBACK_TIMEOUT_S)  # it exits by itself once it has sent everything
        except subprocess.TimeoutExpired:
            stop_process(sender, signal.SIGKILL)
    if received != total_bytes or sender.returncode != 0:
        raise RuntimeError(
            f"loopback measurement failed: {received} of {total_bytes} bytes, sender exit code {sender.returncode}"
        )
    return (total_bytes - first_bytes) / max(elapsed, 1e-9) / 1e9


PROBES = (
    "memcpy_gbps",
    "loopback_tcp_gbps",
    "loopback_tcp_batch_gbps",
    "loopback_tcp_put_gbps",
    "loopback_tcp_get_gbps",
    "memcpy_batch_gbps",
    "memcpy_put_gbps",
    "python_tcp_pingpong_p50_us",
)


def measure_round(batch_bytes: int | None = None, reply_bytes: int = 4096) -> dict:
    """Every probe once: {probe: value} (the batch probes only with batch_bytes).

    loopback_tcp_gbps is the cache-resident best case; loopback_tcp_batch_gbps streams
    through buffers of one batch's bytes. Each operation's own floor has the store's end
    rotate over an arena larger than the cache, as a store's does: loopback_tcp_put_gbps
    (a batch-sized sender into it), loopback_tcp_get_gbps (out of it into a batch-sized
    receiver), memcpy_put_gbps (one thread, a batch into it), memcpy_batch_gbps (one thread,
    out of it into one batch-sized buffer: a GET's). python_tcp_pingpong_p50_us is a Python
    request/reply of `reply_bytes`.
    """
    out = {"memcpy_gbps": memcpy_gbps(), "loopback_tcp_gbps": loopback_tcp_gbps()}
    if batch_bytes:
        arena = max(ARENA_FLOOR_BYTES, 2 * batch_bytes)
        out["loopback_tcp_batch_gbps"] = loopback_tcp_gbps(buffer_bytes=batch_bytes)
        out["loopback_tcp_put_gbps"] = loopback_tcp_gbps(buffer_bytes=arena, sender_buffer_bytes=batch_bytes)
        out["loopback_tcp_get_gbps"] = loopback_tcp_gbps(buffer_bytes=batch_bytes, sender_buffer_bytes=arena)
        out["memcpy_batch_gbps"] = memcpy_batch_gbps(batch_bytes)
        out["memcpy_put_gbps"] = memcpy_put_gbps(batch_bytes)
    out["python_tcp_pingpong_p50_us"] = python_tcp_pingpong_p50_us(reply_bytes)
    return out


def combine_rounds(rounds: list[dict]) -> dict:
    """Per probe: the median over the rounds, and `<probe>_runs`, every round's value in
    round order (index = round), which the per-round ratios pair with the stores' runs."""
    limits = {}
    for probe in PROBES:
        runs = [r[probe] for r in rounds if probe in r]
        if runs:
            limits[probe] = statistics.median(runs)
            limits[f"{probe}_runs"] = runs
    return limits
