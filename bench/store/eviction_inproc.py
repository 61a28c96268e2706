"""Eviction policies on block traces, replayed in process through the node's Store
(gcache._native.Store: the same storage engine and policies as gcache-server, no
sockets), so many traces, seeds and sizes fit in minutes on a small machine.

Per request the calls a KV-cache client makes (as bench/store/eviction_replay.py sends
them to a server): probe the chain (Store.exists: the EXISTS prefix), read the hit
prefix (Store.get until the first miss), put the rest as one chain batch. Memory is
`fraction` x the trace's unique blocks; with disk on, the disk tier is `disk_ratio` x
memory. hit rate = hit blocks / requested blocks.

    .venv/bin/python -m bench.store.eviction_inproc                      # shared + agent traces
    .venv/bin/python -m bench.store.eviction_inproc --traces agent --seeds 0,1,2 --json
    PYTHONPATH=OLD_TREE .venv/bin/python -m bench.store.eviction_inproc  # the same, old build
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from bench.common.paths import TRACE_DIR
from bench.store.agent_traces import SHAPES, agent_trace
from bench.store.eviction_traces import Trace, load_trace
from gcache._native import Store

PAGE = 4096
VALUE = bytes(range(256)) * (PAGE // 256)
MEMORY_MIN_VALUES = 64


def replay(trace: Trace, memory_values: int, disk_values: int, policy: str, data_dir: str = "") -> float:
    """Hit rate of `policy` on `trace` through a fresh Store of that many 4 KiB values."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(
            memory_values * PAGE,
            disk_values * PAGE,
            data_dir or tmp,
            segment_bytes=1 << 20,
            eviction_policy=policy,
            warm_restart=False,
        )
        hits = total = 0
        try:
            for chain in trace.chains:
                keys = [b"b%d" % b for b in chain]
                _, prefix = store.exists(keys)
                got = 0
                while got < prefix and store.get(keys[got]) is not None:
                    got += 1
                hits += got
                total += len(keys)
                if got < len(keys):
                    store.put_batch(keys[got:], [VALUE] * (len(keys) - got))
        finally:
            store.close()
    return hits / max(1, total)


def traces(which: str, seeds: list[int], requests: int, limit: int | None) -> list[Trace]:
    out = []
    if which in ("all", "shared"):
        for name in ("synthetic", "conversation"):
            path = TRACE_DIR / f"{name}_trace.jsonl"
            if path.exists():
                out.append(load_trace(path, limit))
    if which in ("all", "agent"):
        out += [agent_trace(shape, seed, requests) for shape in SHAPES for seed in seeds]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", choices=("all", "shared", "agent"), default="all")
    p.add_argument("--seeds", default="0,1,2", help="agent trace seeds (default 0,1,2)")
    p.add_argument("--requests", type=int, default=2000, help="requests per agent trace (default 2000)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of each shared trace")
    p.add_argument("--fractions", default="0.1,0.25", help="memory / unique blocks (default 0.1,0.25)")
    p.add_argument("--disk", default="off,on", help="off, on or both (default both)")
    p.add_argument("--disk-ratio", type=float, default=2.0, help="disk tier / memory tier with disk on")
    p.add_argument("--policies", default="chain,lru", help="default chain,lru")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    fractions = [float(f) for f in args.fractions.split(",")]
    disks = [d.strip() == "on" for d in args.disk.split(",")]
    policies = [x.strip() for x in args.policies.split(",")]
    rows = []
    for trace in traces(args.traces, seeds, args.requests, args.limit):
        for fraction in fractions:
            memory = max(MEMORY_MIN_VALUES, int(trace.unique_blocks * fraction))
            for disk in disks:
                rates = {
                    pol: replay(trace, memory, int(memory * args.disk_ratio) if disk else 0, pol) for pol in policies
                }
                row = {"trace": trace.name, "fraction": fraction, "disk": disk, **rates}
                if "lru" in rates and "chain" in rates:
                    row["chain/lru"] = rates["chain"] / rates["lru"] if rates["lru"] else float("nan")
                rows.append(row)
                if not args.json:
                    cells = "  ".join(f"{pol} {rates[pol]:.4f}" for pol in policies)
                    ratio = f"  chain/lru {row['chain/lru']:.3f}" if "chain/lru" in row else ""
                    print(
                        f"{trace.name:<24} mem {fraction:<5} disk {'on ' if disk else 'off'}  {cells}{ratio}",
                        flush=True,
                    )
    ratios = [r["chain/lru"] for r in rows if "chain/lru" in r]
    summary = {}
    if ratios:
        summary = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios), "runs": len(ratios)}
    if args.json:
        json.dump({"rows": rows, "chain_over_lru": summary}, sys.stdout, indent=2)
        print()
    elif summary:
        print(
            f"chain/lru over {summary['runs']} runs: min {summary['min']:.3f} median "
            f"{summary['median']:.3f} max {summary['max']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
