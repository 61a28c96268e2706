"""gcache-demo: the README's main job, on embedded defaults.

Starts a local GCache cluster (3 gcache-master replicas + 3 gcache-server
nodes, each on its own loopback address, 256 MiB memory + 512 MiB disk per
node, under ./gcache-data), runs a short gcache-bench through the cluster
client (beside a local redis-server when one is installed), then a short
seeded fault run (kill -9 a node, drain one, join one) that checks every read,
prints what it measured, and stops the cluster with SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from gcache.common.processes import exit_on_sigterm
from gcache.tools.devcluster.checker import run_checker
from gcache.tools.devcluster.local_cluster import LocalCluster
from gcache.tools.storebench import main as bench_main
from gcache.tools.storebench.report import render_table

DEMO_MASTERS, DEMO_NODES = 3, 3
DEMO_MEMORY = "256MiB"  # per node; fits a 2-core, 24 GiB box with room for redis and the bench
DEMO_DISK = "512MiB"
DEMO_BENCH_ARGS = ["--duration", "1s", "--repeat", "3", "--working-set", "64MiB"]
DEMO_FAULTS = ("kill_node", "drain", "join")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gcache-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", default="gcache-data", help="cluster data folder (default ./gcache-data)")
    p.add_argument("--no-redis", action="store_true", help="skip the side-by-side Redis run")
    p.add_argument("--no-faults", action="store_true", help="skip the fault run")
    p.add_argument(
        "--auth",
        action="store_true",
        help="run the cluster with a tenants file and TLS to the masters (gcache-cluster up "
        "--auth --tls); the bench and the fault run use the app tenant's token",
    )
    args = p.parse_args(argv)
    exit_on_sigterm()  # a stopped demo still takes its cluster down

    started = time.monotonic()
    cluster_dir = Path(args.data_dir) / "cluster"
    if (cluster_dir / "cluster.json").exists():
        LocalCluster.load(cluster_dir).down()  # what an interrupted demo left running
    cluster = LocalCluster(
        cluster_dir,
        masters=DEMO_MASTERS,
        nodes=DEMO_NODES,
        memory=DEMO_MEMORY,
        disk=DEMO_DISK,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=2.0,
        auth=args.auth,
        tls=args.auth,
    )
    print(
        f"[gcache-demo] starting {DEMO_MASTERS} masters + {DEMO_NODES} nodes "
        f"(memory {DEMO_MEMORY}, disk {DEMO_DISK} each) under {cluster.dir}",
        flush=True,
    )
    cluster.up()
    ok = True
    try:
        print(f"[gcache-demo] cluster up: {cluster.client_url}", flush=True)
        bench_args = ["--server", cluster.client_url, *DEMO_BENCH_ARGS]
        if args.auth:  # the bench's cluster client: the app token from its file, the CA from the env
            bench_args += ["--token-file", str(cluster.secrets_dir / "app.token")]
            os.environ["GCACHE_MASTER_TLS_CA"] = cluster.client_kwargs["tls_ca"]
        if not args.no_redis and shutil.which("redis-server"):
            bench_args += ["--vs", "redis"]
        print(f"[gcache-demo] gcache-bench {' '.join(bench_args)}", flush=True)
        print(render_table(bench_main.run(bench_args)), flush=True)
        if not args.no_faults:
            print(f"[gcache-demo] fault run: {', '.join(DEMO_FAULTS)} under 3 client threads", flush=True)
            report = run_checker(
                cluster,
                seed=1,
                faults=DEMO_FAULTS,
                threads=3,
                keys_max=1000,
                hold_s=0.5,
                log=lambda line: print(f"[gcache-demo]   {line}", flush=True),
            )
            ok = report["ok"]
            print(
                f"[gcache-demo] {report['calls']} calls, {report['gets']} gets, hit rate "
                f"{report['hit_rate']}, wrong bytes {sum('WRONG' in v for v in report['violations'])}, "
                f"slowest call {report['slowest_call_s']}s (bound {report['call_bound_s']}s), "
                f"timings {report['timings']}: {'OK' if ok else 'FAILED ' + str(report['violations'][:3])}",
                flush=True,
            )
    finally:
        cluster.down()
    print(f"[gcache-demo] cluster stopped; demo took {time.monotonic() - started:.0f}s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
