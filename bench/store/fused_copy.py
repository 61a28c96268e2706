"""The fused XXH3 copy kernel (gcache_native/common/xxh3_copy.cpp) alone, beside memcpy,
XXH3 alone and the copy-then-XXH3 it replaces, over the same bytes, one thread.

    .venv/bin/python -m bench.store.fused_copy [--value-size 256KiB] [--batch 64] [--runs 20] [--hot]

Each run copies a batch of values from a source rotating over 256 MiB into a memfd
arena (mapped as the client maps the server's) rotating over another 256 MiB, so the
bytes come from memory as a PUT's do (--hot: the same batch every run, from cache).
Rounds interleave the kernels (each round runs every kernel once, in turn); prints GB/s
min / median / max per kernel, its median ratio to memcpy's (one np.copyto of the batch, as
gcache-bench's floor), and the load average. The xxh3_copy rows make one Python call per
value (about a microsecond each, as "memcpy, one call per value" shows); the shm_* rows are
the whole batch in one native call at the process's copy level (GCACHE_COPY_LEVEL caps it).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from bench.store.shm_kernels import print_rates
from gcache._native import CHECKSUM_XXH3, copy_levels, shm_read_into, shm_write_from, xxh3, xxh3_copy
from gcache.common.units import parse_size

ROTATION_BYTES = 256 << 20
STREAMING_BYTES_MIN = 128 << 10  # client/shm_copy.cpp kStreamingBytesMin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--value-size", type=parse_size, default=256 << 10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--hot", action="store_true", help="the same batch every run (from cache)")
    args = p.parse_args(argv)
    n, size = args.batch, args.value_size
    batch_bytes = n * size
    slots = 1 if args.hot else max(1, ROTATION_BYTES // batch_bytes)
    region = slots * batch_bytes
    src = np.frombuffer(bytearray(os.urandom(region)), dtype=np.uint8)  # incompressible; the GET's "arena"
    fd = os.memfd_create("gcache-bench-arena")
    os.ftruncate(fd, region)
    arena = mmap.mmap(fd, region)
    os.close(fd)
    arena_np = np.frombuffer(arena, dtype=np.uint8)
    arena_np[:] = 1  # touch every page once
    src_addr, arena_addr = src.ctypes.data, arena_np.ctypes.data
    stream = size >= STREAMING_BYTES_MIN

    def values(i: int) -> list[np.ndarray]:
        base = (i % slots) * batch_bytes
        return [src[base + j * size : base + (j + 1) * size] for j in range(n)]

    def slots_of(i: int) -> list[np.ndarray]:
        base = ((i + slots // 2) % slots) * batch_bytes  # never the source's slot
        return [arena_np[base + j * size : base + (j + 1) * size] for j in range(n)]

    def offsets(i: int) -> list[int]:
        base = ((i + slots // 2) % slots) * batch_bytes
        return [base + j * size for j in range(n)]

    def memcpy(i: int) -> None:  # one call per batch, as gcache-bench's floor
        s, d = (i % slots) * batch_bytes, ((i + slots // 2) % slots) * batch_bytes
        np.copyto(arena_np[d : d + batch_bytes], src[s : s + batch_bytes])

    def memcpy_each(i: int) -> None:
        s, d = (i % slots) * batch_bytes, ((i + slots // 2) % slots) * batch_bytes
        for j in range(n):
            ctypes.memmove(arena_addr + d + j * size, src_addr + s + j * size, size)

    sums = [[xxh3(v) for v in values(k)] for k in range(slots)]  # each slot's, for the GET's check

    def copy_hash(level: str, stream: bool) -> Callable[[int], object]:
        return lambda i: [xxh3_copy(d, v, level=level, stream=stream) for d, v in zip(slots_of(i), values(i))]

    kernels: dict[str, Callable[[int], object]] = {
        "memcpy (baseline)": memcpy,
        "memcpy, one call per value": memcpy_each,
        "XXH3 alone": lambda i: [xxh3(v) for v in values(i)],
        "copy then XXH3 (portable level)": copy_hash("portable", stream),
    }
    for level in copy_levels()[1:]:
        kernels[f"fused {level}"] = copy_hash(level, False)
        kernels[f"fused {level}, streaming stores"] = copy_hash(level, True)
    kinds = [CHECKSUM_XXH3] * n

    def shm_get(i: int) -> list[int]:  # the batch at slot i % slots of src (as the arena) into the arena
        src_offsets = [(i % slots) * batch_bytes + j * size for j in range(n)]
        return shm_read_into(src, src_offsets, [size] * n, sums[i % slots], slots_of(i), 1, True, kinds)

    kernels["shm copy alone (shm_read_into, no verify)"] = lambda i: shm_read_into(
        src, [(i % slots) * batch_bytes + j * size for j in range(n)], [size] * n, [0] * n, slots_of(i), 1, False
    )
    kernels["shm PUT copy (shm_write_from)"] = lambda i: shm_write_from(arena, offsets(i), values(i), 1, CHECKSUM_XXH3)
    kernels["shm GET copy + verify (shm_read_into)"] = shm_get

    rates: dict[str, list[float]] = {name: [] for name in kernels}
    for i in range(args.runs):  # interleaved: each round runs every kernel once
        for name, fn in kernels.items():
            start = time.perf_counter()
            fn(i)
            rates[name].append(batch_bytes / 1e9 / (time.perf_counter() - start))
    if shm_get(0):
        raise SystemExit("fused_copy: a GET's verify failed")
    base = statistics.median(rates["memcpy (baseline)"])
    load = os.getloadavg()
    print(
        f"fused copy: {n} x {size} B = {batch_bytes >> 20} MiB per run, {args.runs} interleaved rounds, "
        f"{'hot (in cache)' if args.hot else f'rotating over {region >> 20} MiB'}, "
        f"{os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print_rates(rates, base, width=40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
