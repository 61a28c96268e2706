"""A data dir written by the release before XXH3 (every record's checksum xxh64):
tests/support/data/xxh64_data_dir/, made once by running this file with that
release's module first on the path:

    PYTHONPATH=<checkout of the release before XXH3> python tests/support/xxh64_data_dir.py OUT_DIR

`expected_values()` says exactly what it holds; the upgrade tests open a copy of
it with the current build and compare every byte.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "data" / "xxh64_data_dir"
KIB = 1 << 10
MIB = 1 << 20
# Sizes around the small-slot classes, the 4 KiB block and the streaming-copy cut.
SIZES = [0, 1, 63, 64, 65, 2047, 2048, 4095, 4096, 40 * KIB, 130 * KIB, 256 * KIB]
ARENA_BYTES = 512 * KIB  # smaller than the values: some are on disk only, some in the warm list too
DISK_BYTES = 16 * MIB
SEGMENT_BYTES = 256 * KIB


def expected_values() -> dict[bytes, bytes]:
    out = {}
    for i in range(16):
        size = SIZES[i % len(SIZES)]
        out[b"old-key-%d" % i] = random.Random(i).randbytes(size)
    return out


def write(data_dir: str) -> None:
    from gcache._native import Store

    store = Store(ARENA_BYTES, DISK_BYTES, data_dir, segment_bytes=SEGMENT_BYTES)
    for key, value in expected_values().items():
        assert store.put(key, value) == Store.STORED, key
    store.remove(b"old-key-3")  # a tombstone too
    store.flush()
    store.close()


if __name__ == "__main__":
    write(sys.argv[1])
