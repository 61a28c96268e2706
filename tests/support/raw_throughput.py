"""Raw-protocol throughput of a gcache-server: PUT and GET of 64 x 256 KiB batches.

Not a test (no timing assertions anywhere): a measurement tool for the data
path alone, independent of gcache.client. Usage:

    .venv/bin/python -m tests.support.raw_throughput [--seconds 3] [--batch 64] [--value-kib 256]

Starts its own gcache-server on a free port, moves bytes with
gcache._native.send_buffers / recv_into_buffers (GIL released, no copies into
Python bytes), prints GB/s per direction (median of 3 runs). PUT removes old
batches as it goes so the memory tier never evicts: this measures the data
path, not the disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import msgpack

from gcache._native import recv_into_buffers, send_buffers, xxh64
from tests.support.raw_protocol import GET_BATCH, HEADER, MAGIC, PUT_BATCH, REMOVE_BATCH, RawConnection
from tests.support.servers import ServerProcess

RESIDENT_BATCHES = 8  # batches kept stored while PUT runs (8 x 16 MiB by default)


def recv_frame_into(sock, payload: memoryview) -> tuple[tuple, dict]:
    head = bytearray(32)
    recv_into_buffers(sock.fileno(), [head], 30000)
    fields = HEADER.unpack(head)
    meta_buf = bytearray(fields[5])
    recv_into_buffers(sock.fileno(), [meta_buf], 30000)
    if fields[7]:
        recv_into_buffers(sock.fileno(), [payload[: fields[7]]], 30000)
    return fields, msgpack.unpackb(meta_buf)


def measure(port: int, batch: int, value_bytes: int, seconds: float) -> tuple[float, float]:
    values = memoryview(bytearray(os.urandom(batch * value_bytes)))
    sums = [xxh64(values[i * value_bytes : (i + 1) * value_bytes]) for i in range(batch)]
    sink = memoryview(bytearray(batch * value_bytes))
    with RawConnection(port) as c:
        sock = c.sock
        sock.setblocking(True)
        # PUT: fresh keys every batch, so every value is really stored.
        moved, start, n = 0, time.perf_counter(), 0
        keys_written = []
        while time.perf_counter() - start < seconds:
            keys = [f"b{n}-{i}".encode() for i in range(batch)]
            meta = msgpack.packb({"keys": keys, "lens": [value_bytes] * batch, "sums": sums})
            head = HEADER.pack(MAGIC, 1, PUT_BATCH, 0, n, len(meta), 0, len(values))
            send_buffers(sock.fileno(), [head, meta, values], 30000)
            fields, reply = recv_frame_into(sock, sink)
            assert fields[6] == 0 and reply["st"] == [0] * batch, reply
            moved += len(values)
            keys_written.append(keys)
            n += 1
            if len(keys_written) > RESIDENT_BATCHES:  # stay inside the memory tier: no eviction
                old = msgpack.packb({"keys": keys_written.pop(0)})
                c.send(HEADER.pack(MAGIC, 1, REMOVE_BATCH, 0, n, len(old), 0, 0) + old)
                assert c.recv_frame().status == 0
        put_gbps = moved / (time.perf_counter() - start) / 1e9
        # GET the batches just written (the most recent ones are in memory).
        moved, start, i = 0, time.perf_counter(), 0
        recent = keys_written[-4:]
        while time.perf_counter() - start < seconds:
            keys = recent[i % len(recent)]
            meta = msgpack.packb({"keys": keys})
            send_buffers(sock.fileno(), [HEADER.pack(MAGIC, 1, GET_BATCH, 0, i, len(meta), 0, 0), meta], 30000)
            fields, reply = recv_frame_into(sock, sink)
            assert fields[6] == 0 and fields[7] == batch * value_bytes, reply
            moved += fields[7]
            i += 1
        get_gbps = moved / (time.perf_counter() - start) / 1e9
        for keys in keys_written:  # leave room for the next run
            meta = msgpack.packb({"keys": keys})
            c.send(HEADER.pack(MAGIC, 1, REMOVE_BATCH, 0, 0, len(meta), 0, 0) + meta)
            c.recv_frame()
    return put_gbps, get_gbps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--value-kib", type=int, default=256)
    p.add_argument("--memory", default="1GiB")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(tmp) / "node", memory=args.memory, disk="4GiB").start()
        try:
            runs = [measure(server.port, args.batch, args.value_kib << 10, args.seconds) for _ in range(3)]
        finally:
            server.stop()
    put = statistics.median(r[0] for r in runs)
    get = statistics.median(r[1] for r in runs)
    print(f"batch {args.batch} x {args.value_kib} KiB, median of 3 runs of {args.seconds}s each:")
    print(f"  PUT {put:.2f} GB/s   (runs: {', '.join(f'{r[0]:.2f}' for r in runs)})")
    print(f"  GET {get:.2f} GB/s   (runs: {', '.join(f'{r[1]:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
