"""The fused XXH3 copy kernel (gcache_native/common/xxh3_copy.cpp): at every copy level
this CPU runs, the copy is exact, nothing past its end is written, and the sum is
libxxhash's XXH3_64bits of the bytes, for every length up to 2 KiB, random lengths up
to 4 MiB and odd alignments of source and destination, with and without streaming
stores. GCACHE_COPY_LEVEL caps the level the shm copies use."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gcache._native import copy_level, copy_levels, xxh3, xxh3_copy

LEVELS = copy_levels()
SENTINEL = 0xA5


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def aligned_view(n: int, align_mod_64: int) -> tuple[np.ndarray, int, np.ndarray]:
    """n bytes whose address is align_mod_64 past a 64-byte boundary, inside a buffer with a
    sentinel-filled margin of at least 64 bytes on each side: (whole buffer, start, the n bytes)."""
    whole = np.full(n + 256, SENTINEL, dtype=np.uint8)
    start = 64 + (align_mod_64 - whole.ctypes.data - 64) % 64
    return whole, start, whole[start : start + n]


def check_copy(src: bytes, level: str, *, dst_align: int, stream: bool, hash_destination: bool) -> None:
    whole, start, dst = aligned_view(len(src), dst_align)
    got = xxh3_copy(dst, src, level=level, stream=stream, hash_destination=hash_destination)
    where = (level, len(src), dst_align, stream, hash_destination)
    assert got == xxh3(src), where
    assert dst.tobytes() == src, where
    # Nothing outside the copy was written (the last stripe is stored at len - 64, never past len).
    assert not np.any(whole[:start] != SENTINEL) and not np.any(whole[start + len(src) :] != SENTINEL), where


def test_the_levels_this_cpu_runs_are_all_offered():
    assert LEVELS[0] == "portable"
    flags = cpu_flags()
    if "avx2" in flags:  # CI's machines have it: the fused kernel is tested, never skipped there
        assert "avx2" in LEVELS
    if "avx512f" in flags:
        assert "avx512" in LEVELS
    assert copy_level() in LEVELS


@pytest.mark.parametrize("level", LEVELS)
def test_every_length_up_to_2k(level):
    rng = random.Random(1)
    data = rng.randbytes(2048 + 64)
    for n in range(0, 2049):
        src = data[n % 64 : n % 64 + n]  # the source's alignment varies with n
        dst_align = (0, 16, 32, 48, n % 64)[(n // 2) % 5]  # each alignment with and without streaming
        check_copy(src, level, dst_align=dst_align, stream=bool(n & 1), hash_destination=bool(n & 2))


@pytest.mark.parametrize("level", LEVELS)
def test_random_lengths_and_alignments_up_to_4mib(level):
    rng = random.Random(2)
    pool = np.frombuffer(rng.randbytes((4 << 20) + 64), dtype=np.uint8)
    sizes = [241, 255, 256, 257, 1023, 1024, 1025, 1088, 1089, (64 << 10) + 1, 4 << 20]
    sizes += [rng.randrange(241, 4 << 20) for _ in range(20)]
    for i, n in enumerate(sizes):
        src_align = rng.randrange(64) if n < (4 << 20) else 0
        src = pool[src_align : src_align + n]
        for dst_align in (0, 16, 32, rng.randrange(64)):
            check_copy(bytes(src), level, dst_align=dst_align, stream=bool(i & 1), hash_destination=bool(i & 2))


def test_bad_arguments_copy_nothing():
    dst = bytearray(b"x" * 10)
    with pytest.raises(ValueError, match="unknown copy level"):
        xxh3_copy(dst, b"abc", level="sse9")
    with pytest.raises(ValueError, match="smaller"):
        xxh3_copy(dst, b"a" * 11)
    assert dst == b"x" * 10


CHILD = r"""
import json, mmap, os, random
from gcache._native import CHECKSUM_XXH3, copy_level, shm_read_into, shm_write_from, xxh3
fd = os.memfd_create("gcache-test-arena")
os.ftruncate(fd, 32 << 20)
arena = mmap.mmap(fd, 32 << 20)
os.close(fd)
rng = random.Random(3)
values = [rng.randbytes(n) for n in (0, 100, 241, 5000, 256 << 10, (3 << 20) + 17)]
offsets, at = [], 0
for v in values:
    offsets.append(at)
    at += (len(v) + 4095) // 4096 * 4096
sums = shm_write_from(arena, offsets, values, 2, CHECKSUM_XXH3)
targets = [bytearray(len(v)) for v in values]
bad = shm_read_into(arena, offsets, [len(v) for v in values], sums, targets, 2, True, [CHECKSUM_XXH3] * len(values))
print(json.dumps({"level": copy_level(), "sums_ok": sums == [xxh3(v) for v in values], "bad": bad,
                  "bytes_ok": [bytes(t) for t in targets] == values}))
"""


@pytest.mark.process
@pytest.mark.parametrize("asked", ["portable", "avx2", "avx512", None])
def test_the_shm_copies_at_each_forced_level(asked):
    env = {k: v for k, v in os.environ.items() if k != "GCACHE_COPY_LEVEL"}
    if asked is not None:
        env["GCACHE_COPY_LEVEL"] = asked
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    best = LEVELS[-1]
    # A level the CPU lacks is capped at the best it has; unset means the best.
    expected = best if asked is None or asked not in LEVELS else asked
    assert got == {"level": expected, "sums_ok": True, "bad": [], "bytes_ok": True}
