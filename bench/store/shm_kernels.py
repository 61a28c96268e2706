"""Where a one-sided (shm) GET or PUT spends its time: the native copy kernels
beside memcpy, XXH3 and the old xxh64 of the same bytes, in one run.

    .venv/bin/python -m bench.store.shm_kernels [--batch 64] [--value-size 256KiB] [--runs 30]

The arena is a memfd mapped as the client maps the server's; the source
rotates over 256 MiB so reads are not served from cache alone. Prints GB/s
min / median / max per kernel and its ratio to the single-threaded memcpy of
the same bytes (median). A PUT hashes every byte twice (the client's sum while
it copies, the node's check at COMMIT) besides the copy, so the checksum's rate
bounds it: XXH3 (libxxhash, AVX2 / AVX-512) against the xxh64 of before; a GET
under a proven lease copies only.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time

import numpy as np

from gcache._native import CHECKSUM_XXH3, CHECKSUM_XXH64, shm_read_into, shm_write_from, xxh3, xxh64
from gcache.common.units import parse_size

ARENA_BYTES = 512 << 20
ROTATION_BYTES = 256 << 20


def timed(fn, runs: int, nbytes: int) -> list[float]:
    rates = []
    for i in range(runs):
        start = time.perf_counter()
        fn(i)
        rates.append(nbytes / 1e9 / (time.perf_counter() - start))
    return rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--value-size", type=parse_size, default=256 << 10)
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args(argv)
    n, size = args.batch, args.value_size
    batch_bytes = n * size
    slots = max(1, ROTATION_BYTES // batch_bytes)
    fd = os.memfd_create("gcache-bench-arena")
    os.ftruncate(fd, ARENA_BYTES)
    arena = mmap.mmap(fd, ARENA_BYTES)
    os.close(fd)
    arena_addr = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    ctypes.memset(arena_addr, 7, ROTATION_BYTES + batch_bytes)  # touch every page once
    dst = np.zeros(batch_bytes, dtype=np.uint8)
    targets = [memoryview(dst)[i * size : (i + 1) * size] for i in range(n)]
    sums64 = [xxh64(arena[i * size : (i + 1) * size]) for i in range(n)]
    sums3 = [xxh3(arena[i * size : (i + 1) * size]) for i in range(n)]

    def offsets(i: int) -> list[int]:
        base = (i % slots) * batch_bytes
        return [base + j * size for j in range(n)]

    write_base = ROTATION_BYTES
    kernels = {
        "memcpy, one thread (baseline)": lambda i: ctypes.memmove(
            dst.ctypes.data, arena_addr + (i % slots) * batch_bytes, batch_bytes
        ),
        "xxh64 of the batch, one thread": lambda i: [xxh64(t) for t in targets],
        "XXH3 of the batch, one thread": lambda i: [xxh3(t) for t in targets],
    }
    for threads in (1, 2):
        kernels[f"GET copy (lease-proven), {threads} thread(s)"] = lambda i, t=threads: shm_read_into(
            arena, offsets(i), [size] * n, sums64, targets, t, False
        )
        for name, kind, sums in (("xxh64", CHECKSUM_XXH64, sums64), ("XXH3", CHECKSUM_XXH3, sums3)):
            kernels[f"GET copy + {name} check, {threads} thread(s)"] = lambda i, t=threads, k=kind, s=sums: (
                shm_read_into(arena, offsets(0), [size] * n, s, targets, t, True, [k] * n)
            )
            kernels[f"PUT copy + {name} sum, {threads} thread(s)"] = lambda i, t=threads, k=kind: shm_write_from(
                arena, [write_base + j * size for j in range(n)], targets, t, k
            )
    results = {name: timed(fn, args.runs, batch_bytes) for name, fn in kernels.items()}
    base = statistics.median(results["memcpy, one thread (baseline)"])
    print(f"shm kernels: {n} x {size} B = {batch_bytes >> 20} MiB per call, {args.runs} runs, {os.cpu_count()} cores")
    print_rates(results, base)
    return 0


def print_rates(rates: dict[str, list[float]], base: float, width: int = 44) -> None:
    """One line per kernel: GB/s min / median / max and the median's ratio to `base`."""
    print(f"{'kernel':{width}s} {'GB/s min / median / max':>26s}  vs memcpy")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:{width}s} {min(r):7.2f} / {med:6.2f} / {max(r):6.2f}  {med / base:8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
