"""Reads the connector's debug digests (GCACHE_VLLM_DIGESTS, gcache/integrations/vllm/transfer/digests.py)
of any number of engines and runs: `python -m bench.vllm.digest_check FOLDER`.

Prints, per key: more than one digest saved (the same prefix's KV staged with different
bytes: numerics, or a save that read a block before or after its page was written), a
load whose read bytes or block bytes match no saved digest (wrong bytes), and a load
whose block differs from what it read (the copy into the block). Exit status 1 on any.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    saved: dict[str, set[str]] = defaultdict(set)
    loads: list[tuple[str, str, str, str, str]] = []  # (file, kind, key, digest, tag)
    for path in sorted(Path(argv[0]).glob("digests-*.txt")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 5 or parts[0] not in "SRL":
                continue
            kind, key, digest, _block, tag = parts[:5]
            if kind == "S":
                saved[key].add(digest)
            else:
                loads.append((path.name, kind, key, digest, tag))
    twice = {k: d for k, d in saved.items() if len(d) > 1}
    wrong = [x for x in loads if x[3] not in saved.get(x[2], set())]
    unknown = [x for x in wrong if x[2] not in saved]
    print(f"keys saved {len(saved)}, saved with >1 digest {len(twice)}; loads logged {len(loads)}")
    print(f"loaded values matching no saved digest: {len(wrong)} ({len(unknown)} of keys never saved in this log)")
    for k, d in list(twice.items())[:10]:
        print("  saved twice:", k[:40], sorted(d))
    for x in wrong[:20]:
        print("  wrong load:", x[0], x[1], x[2][:40], x[3], x[4], "saved:", sorted(saved.get(x[2], ())))
    return 1 if twice or wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
