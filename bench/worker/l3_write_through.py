"""The worker's write-through to L3, alone: what L3Store._write does for each job
(one `batch_put_from` of a job's pages out of the registered host pool, the
page bytes never copied in Python), against a local gcache-server, per transport.

    .venv/bin/python -m bench.worker.l3_write_through [--page-bytes 1MiB] [--pages 16]
        [--jobs 16] [--repeat 5] [--transport tcp,shm]

Each job writes new keys (values are immutable), so every byte goes to the node.
Prints L2 -> L3 GB/s min / median / max per transport. Run it with PYTHONPATH at
two checkouts, interleaved, to compare them on a loaded machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import gcache
from gcache.common.units import parse_size
from gcache.tools.devcluster.local_server import LocalServer


def one_run(client, pool: np.ndarray, page_bytes: int, pages: int, jobs: int, tag: str) -> float:
    slots = pool.size // page_bytes
    start = time.perf_counter()
    for j in range(jobs):
        first = (j * pages) % (slots - pages + 1)
        keys = [f"{tag}-{j}-{p}" for p in range(pages)]
        bufs = [pool[(first + p) * page_bytes : (first + p + 1) * page_bytes] for p in range(pages)]
        ok = client.batch_put_from(keys, bufs, sizes=[page_bytes] * pages)
        if not all(ok):
            raise SystemExit(f"job {j}: a put was refused ({ok}); give the server more --memory")
    return jobs * pages * page_bytes / 1e9 / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-bytes", type=parse_size, default=1 << 20)
    p.add_argument("--pages", type=int, default=16, help="pages per write job (default 16)")
    p.add_argument("--jobs", type=int, default=16, help="jobs per run (default 16)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--transport", default="tcp,shm")
    p.add_argument("--pool-bytes", type=parse_size, default=256 << 20, help="host pool the pages come from")
    args = p.parse_args(argv)
    pool = np.frombuffer(bytearray(os.urandom(1 << 20)) * (args.pool_bytes >> 20), dtype=np.uint8)
    need = args.repeat * args.jobs * args.pages * args.page_bytes + (256 << 20)
    print(
        f"l3 write-through: jobs of {args.pages} x {args.page_bytes >> 10} KiB pages, {args.jobs} jobs per run, "
        f"{args.repeat} runs; gcache from {Path(gcache.__file__).parent.parent}; load {os.getloadavg()[0]:.1f}"
    )
    for transport in args.transport.split(","):
        with tempfile.TemporaryDirectory(prefix="l3wt-") as tmp:
            server = LocalServer(Path(tmp), memory=str(need), disk="0", extra_args=["--log-level", "warning"]).start()
            try:
                client = gcache.Client(server.address, transport=transport, verify_checksums=True)
                client.register_buffer(pool)
                one_run(client, pool, args.page_bytes, args.pages, 2, f"warm-{transport}")
                rates = [
                    one_run(client, pool, args.page_bytes, args.pages, args.jobs, f"{transport}-{r}")
                    for r in range(args.repeat)
                ]
                client.close()
            finally:
                server.stop()
        print(
            f"  {transport:4s} L2 -> L3 GB/s  min {min(rates):.3f}  median {statistics.median(rates):.3f}  "
            f"max {max(rates):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
