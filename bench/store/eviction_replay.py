"""Eviction policies on real KV-cache traces, replayed against a real gcache-server.

For each trace, memory size and disk setting, one fresh gcache-server per eviction policy
(`--eviction-policy`, everything else equal) gets the calls a KV-cache client makes for
each request of the trace, in order, from one client:

  p = batch_exists_prefix(chain)           how much of the prompt's chain is cached
  get_batch(chain[:p])                     read it; h = leading values actually returned
  put_batch(chain[h:], values)             store the rest, as one chain batch

hit rate = sum(h) / requested blocks. Values are `--value-bytes` (4 KiB) each; memory is
`fraction` x unique blocks x value bytes; with disk on, the disk tier is `--disk-ratio` x
the memory tier. Printed beside each policy: its ratio to plain LRU (the same server,
`--eviction-policy lru`) and the clairvoyant (Belady) hit rate on the same access sequence
(bench/store/eviction_traces.py), for memory alone and, with disk on, for memory + disk as one
cache of their summed size (an upper bound). `exists>get` counts blocks that
batch_exists_prefix reported present and the following get_batch missed; `to disk` the
values written to disk on eviction (demotions); `weight` the chain policy's fresh weight
at the end of the run (docs/storage.md).

  .venv/bin/python -m bench.store.eviction_replay   # both traces, ~10 min
  .venv/bin/python -m bench.store.eviction_replay --fractions 0.1 --disk off --repeat 3
  .venv/bin/python -m bench.store.eviction_replay --limit 300 --policies chain,lru   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gcache
from bench.common.paths import TRACE_DIR
from bench.common.stats import columns
from bench.store.agent_traces import SHAPES, agent_trace
from bench.store.eviction_traces import Trace, clairvoyant_hit_rate, load_trace
from gcache.tools.devcluster.local_server import LocalServer

MEMORY_MIN = 1 << 20  # gcache-server's --memory floor
POLICIES = ("chain", "s3fifo", "lru")


@dataclass
class Run:
    trace: str
    fraction: float
    disk: bool
    policy: str
    hit_rate: float
    seconds: float
    exists_then_missed: int
    counters: dict = field(default_factory=dict)
    gauges: dict = field(default_factory=dict)


def replay(client, trace: Trace, value: bytes) -> tuple[int, int]:
    """Replays every request; returns (hit blocks, blocks exists reported but get missed)."""
    hits = exists_then_missed = 0
    for r, chain in enumerate(trace.chains):
        keys = [b"%s/%x" % (trace.name.encode(), block) for block in chain]
        probed = client.batch_exists_prefix(keys)
        got = client.get_batch(keys[:probed]) if probed else []
        hit = 0
        while hit < len(got) and got[hit] is not None:
            hit += 1
        hits += hit
        exists_then_missed += sum(1 for v in got if v is None)
        if hit < len(keys):
            client.put_batch(keys[hit:], [value] * (len(keys) - hit))
    return hits, exists_then_missed


def memory_bytes(trace: Trace, fraction: float, value_bytes: int) -> int:
    return max(MEMORY_MIN, int(trace.unique_blocks * fraction) * value_bytes)


def run_one(trace: Trace, fraction: float, disk: bool, policy: str, args, workdir: Path) -> Run:
    memory = memory_bytes(trace, fraction, args.value_bytes)
    disk_bytes = int(memory * args.disk_ratio) if disk else 0
    extra = ["--log-level", "warning", "--admin-port", "0"]
    if policy != "default":
        extra += ["--eviction-policy", policy]
    if disk:
        extra += ["--segment-bytes", str(max(1 << 20, disk_bytes // 16))]
    extra += args.server_arg
    data_dir = Path(tempfile.mkdtemp(prefix=f"{trace.name}-{policy}-", dir=workdir))
    server = LocalServer(data_dir, memory=str(memory), disk=str(disk_bytes), extra_args=extra).start()
    value = os.urandom(args.value_bytes)
    try:
        with gcache.Client(server.address, timeout_s=60) as client:
            t0 = time.monotonic()
            hits, missed = replay(client, trace, value)
            seconds = time.monotonic() - t0
            stats = client.stats()
    finally:
        server.stop()
    return Run(
        trace.name,
        fraction,
        disk,
        policy,
        hits / max(1, trace.blocks),
        seconds,
        missed,
        stats.get("counters", {}),
        stats.get("gauges", {}),
    )


def weight(runs: list[Run]) -> str:
    """The chain policy's fresh weight at the end of the run (tuned or fixed); '-' for others."""
    pct = [r.gauges["eviction_fresh_weight_pct"] for r in runs if "eviction_fresh_weight_pct" in r.gauges]
    return f"{statistics.median(pct) / 100:g}" if pct else "-"


def fmt_rate(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return columns(values, "{:.4f}", sep="/")


def print_table(trace: Trace, args, runs: list[Run]) -> None:
    print(
        f"\n## {trace.name}: {len(trace.chains)} requests, {trace.blocks} blocks, "
        f"{trace.unique_blocks} unique; {args.value_bytes} B values"
    )
    print(
        f"{'memory':>7} {'disk':>5} {'policy':>8} {'hit rate':>22} {'vs lru':>7} {'vs clairv.':>10} "
        f"{'clairvoyant':>11} {'exists>get':>10} {'evict mem':>9} {'to disk':>8} {'hits disk':>9} "
        f"{'weight':>6} {'secs':>5}"
    )
    for fraction in args.fractions:
        capacity = memory_bytes(trace, fraction, args.value_bytes) // args.value_bytes
        bound_memory = clairvoyant_hit_rate(trace, capacity)
        for disk in args.disk_modes:
            bound = bound_memory
            if disk:
                bound = clairvoyant_hit_rate(trace, int(capacity * (1 + args.disk_ratio)))
            by_policy = {
                p: [r for r in runs if r.fraction == fraction and r.disk == disk and r.policy == p]
                for p in args.policies
            }
            lru = statistics.median(r.hit_rate for r in by_policy["lru"]) if by_policy.get("lru") else None
            for policy, rs in by_policy.items():
                if not rs:
                    continue
                rates = [r.hit_rate for r in rs]
                median = statistics.median(rates)
                vs_lru = f"{median / lru:.3f}" if lru else "-"
                print(
                    f"{'1/%g' % (1 / fraction):>7} {'on' if disk else 'off':>5} {policy:>8} "
                    f"{fmt_rate(rates):>22} {vs_lru:>7} {median / max(bound, 1e-9):>10.3f} {bound:>11.4f} "
                    f"{max(r.exists_then_missed for r in rs):>10} "
                    f"{statistics.median(r.counters.get('evictions_memory', 0) for r in rs):>9.0f} "
                    f"{statistics.median(r.counters.get('demotions_to_disk', 0) for r in rs):>8.0f} "
                    f"{statistics.median(r.counters.get('hits_disk', 0) for r in rs):>9.0f} "
                    f"{weight(rs):>6} {statistics.median(r.seconds for r in rs):>5.1f}"
                )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--traces",
        nargs="+",
        type=Path,
        default=sorted(TRACE_DIR.glob("*.jsonl")),
        help=f"trace files (default: every *.jsonl in {TRACE_DIR})",
    )
    p.add_argument(
        "--agent",
        default="",
        help="also generated agent-style traces (bench/store/agent_traces.py): 'all' (every shape, "
        "seeds 0-2) or SHAPE:SEED,... e.g. tools:0,adversarial:0 (default none)",
    )
    p.add_argument("--agent-requests", type=int, default=2000, help="requests per agent trace (default 2000)")
    p.add_argument(
        "--fractions",
        nargs="+",
        type=float,
        default=[0.1, 0.25],
        help="memory tier as a fraction of each trace's unique blocks (default 0.1 0.25)",
    )
    p.add_argument("--disk", choices=["off", "on", "both"], default="both", help="disk tier (default both)")
    p.add_argument("--disk-ratio", type=float, default=1.0, help="disk tier size / memory tier size (default 1)")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"--eviction-policy values to compare (default {','.join(POLICIES)}; 'default' = no flag)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per setting; min/median/max shown (default 1)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests of each trace")
    p.add_argument("--value-bytes", type=int, default=4096, help="bytes per block value (default 4096)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra gcache-server argument, repeatable (e.g. --server-arg=--eviction-fresh-weight=2)",
    )
    p.add_argument("--json", type=Path, help="also write every run as JSON here")
    p.add_argument(
        "--plot", type=Path, help="also draw hit rate vs memory fraction per policy beside clairvoyant (PNG)"
    )
    args = p.parse_args(argv)
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    args.disk_modes = {"off": [False], "on": [True], "both": [False, True]}[args.disk]
    for f in args.fractions:
        if not 0 < f <= 1:
            p.error("--fractions must be in (0, 1]")
    if args.repeat < 1 or args.value_bytes < 1 or args.disk_ratio <= 0:
        p.error("--repeat, --value-bytes and --disk-ratio must be positive")
    args.agent_traces = []
    for item in [x.strip() for x in args.agent.split(",") if x.strip()]:
        if item == "all":
            args.agent_traces += [(shape, seed) for shape in SHAPES for seed in range(3)]
            continue
        shape, _, seed = item.partition(":")
        if shape not in SHAPES or not seed.isdigit():
            p.error(f"--agent takes 'all' or SHAPE:SEED with SHAPE one of {', '.join(SHAPES)}, got {item!r}")
        args.agent_traces.append((shape, int(seed)))
    if not args.traces and not args.agent_traces:
        p.error(f"no traces given and none found in {TRACE_DIR}")
    return args


def plot_runs(traces: list[Trace], args, runs: list[Run], path: Path) -> None:
    """One panel per trace and disk mode: median hit rate vs memory fraction for each
    policy, with the clairvoyant (Belady) bound at the same capacity."""
    from gcache.tools.plotting import charts

    plt = charts.pyplot()
    panels = [(t, disk) for t in traces for disk in args.disk_modes]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4), squeeze=False)
    fractions = sorted(args.fractions)
    for ax, (trace, disk) in zip(axes[0], panels):
        series = {}
        for policy in args.policies:
            rates = [r.hit_rate for r in runs if r.trace == trace.name and r.disk == disk and r.policy == policy]
            if rates:
                by_fraction = [
                    statistics.median(
                        r.hit_rate
                        for r in runs
                        if r.trace == trace.name and r.disk == disk and r.policy == policy and r.fraction == f
                    )
                    for f in fractions
                ]
                series[policy] = (fractions, by_fraction)
        factor = 1 + args.disk_ratio if disk else 1
        series["clairvoyant"] = (
            fractions,
            [
                clairvoyant_hit_rate(trace, int(memory_bytes(trace, f, args.value_bytes) // args.value_bytes * factor))
                for f in fractions
            ],
        )
        charts.line_panel(
            ax, f"{trace.name}, disk {'on' if disk else 'off'}", "memory / unique blocks", "hit rate", series
        )
    charts.save(fig, str(path))


def main(argv=None) -> int:
    args = parse_args(argv)
    print("command:", " ".join([Path(sys.executable).name, "-m", "bench.store.eviction_replay", *sys.argv[1:]]))
    print(
        f"calls per request: batch_exists_prefix(chain), get_batch(hit prefix), put_batch(rest); "
        f"disk = {args.disk_ratio:g} x memory; policies {', '.join(args.policies)}; repeat {args.repeat}"
    )
    runs: list[Run] = []
    traces: list[Trace] = []
    with tempfile.TemporaryDirectory(prefix="eviction-replay-") as tmp:
        makers = [lambda path=path: load_trace(path, args.limit) for path in args.traces]
        makers += [lambda s=s, n=n: agent_trace(s, n, args.agent_requests) for s, n in args.agent_traces]
        for make_trace in makers:
            trace = make_trace()
            traces.append(trace)
            for fraction in args.fractions:
                for disk in args.disk_modes:
                    for _ in range(args.repeat):
                        for policy in args.policies:
                            runs.append(run_one(trace, fraction, disk, policy, args, Path(tmp)))
            print_table(trace, args, [r for r in runs if r.trace == trace.name])
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    if args.plot:
        plot_runs(traces, args, runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
