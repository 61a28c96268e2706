"""What authentication costs on the data path: gcache-bench's PUT/GET/single-GET figures
with and without --auth-file, runs interleaved, min/median/max over runs, ratio of medians.

  .venv/bin/python -m bench.store.auth_overhead --runs 5
  .venv/bin/python -m bench.store.auth_overhead --runs 5 --baseline-python /path/to/other/.venv/bin/python

Each run starts a local gcache-server (bench/store/run_targets.sh's settings: 1 GiB memory,
2 GiB disk, 64-key batches of 256 KiB values, one client thread, single GETs of 4 KiB).
--baseline-python adds a third column: the same bench under another checkout's interpreter
(e.g. the tree before this change), without auth. Prints the exact commands it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.common.paths import REPO
from bench.common.stats import columns

MEASURES = (
    ("put", "gbps", "PUT GB/s", True),
    ("get", "gbps", "GET GB/s", True),
    ("latency", "p50_us", "single GET p50 us", False),
    ("latency", "p99_us", "single GET p99 us", False),
)
AUTH_FILE = """[tenants.bench]
token = "bench-secret-0123456789abcdef"
roles = ["read", "write"]
"""


def bench_command(python: str, args, auth_file: str | None) -> list[str]:
    command = [
        python,
        "-m",
        "gcache.tools.storebench.main",
        "--memory",
        "1GiB",
        "--disk",
        "2GiB",
        "--value-size",
        args.value_size,
        "--batch",
        str(args.batch),
        "--threads",
        "1",
        "--duration",
        args.duration,
        "--repeat",
        "1",
        "--workload",
        "put,get,latency",
        "--latency-value-size",
        "4KiB",
        "--json",
        "--no-progress",
    ]
    return command + (["--auth-file", auth_file] if auth_file else [])


def run_once(command: list[str], cwd: str) -> dict:
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)
    if out.returncode != 0:
        raise SystemExit(f"bench failed ({' '.join(command)}):\n{out.stderr[-2000:]}")
    workloads = json.loads(out.stdout)["peers"]["gcache"]["workloads"]
    return {label: workloads[w][field] for w, field, label, _ in MEASURES}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs per configuration, interleaved (default 5)")
    p.add_argument("--duration", default="3s", help="timed seconds per workload run (default 3s)")
    p.add_argument("--value-size", default="256KiB")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--baseline-python", help="interpreter of another checkout to run without auth beside")
    p.add_argument("--baseline-cwd", help="that checkout's root (default: the interpreter's ../..)")
    args = p.parse_args(argv)
    if not 1 <= args.runs <= 50:
        p.error("--runs must be 1..50")
    here = str(REPO)
    with tempfile.TemporaryDirectory() as tmp:
        auth_file = os.path.join(tmp, "auth.toml")
        with open(auth_file, "w") as f:
            f.write(AUTH_FILE)
        os.chmod(auth_file, 0o600)
        configs = {
            "no auth": (bench_command(sys.executable, args, None), here),
            "auth": (bench_command(sys.executable, args, auth_file), here),
        }
        if args.baseline_python:
            cwd = args.baseline_cwd or os.path.dirname(os.path.dirname(os.path.dirname(args.baseline_python)))
            configs["baseline"] = (bench_command(args.baseline_python, args, None), cwd)
        results: dict[str, list[dict]] = {name: [] for name in configs}
        for i in range(args.runs):
            for name, (command, cwd) in configs.items():
                results[name].append(run_once(command, cwd))
                print(f"run {i + 1}/{args.runs} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    print("commands:")
    for name, (command, cwd) in configs.items():
        print(f"  {name} (in {cwd}): {' '.join(command)}")
    print(f"working set: 256 MiB per worker (gcache-bench default); {args.runs} runs each, interleaved\n")
    print(f"{'measure':20s} {'config':9s} {'min':>9s} {'median':>9s} {'max':>9s}   ratio of medians (auth / x)")
    for _, _, label, higher_better in MEASURES:
        auth_median = statistics.median(r[label] for r in results["auth"])
        for name in configs:
            values = [r[label] for r in results[name]]
            ratio = "" if name == "auth" else f"   {auth_median / statistics.median(values):.3f}"
            print(f"{label:20s} {name:9s} {columns(values, '{:9.3f}')}{ratio}")
        print(f"{'':20s} ({'higher' if higher_better else 'lower'} is better)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
