"""What the cluster client costs over talking to one node directly.

Starts 3 local gcache-server processes, builds a cluster map of them (no
master: the ClusterClient starts from `initial_map`), and runs the same
workloads through gcache.Client on one node and through gcache.ClusterClient
on the cluster, side by side:

  exists   batch_is_exist of 10,000 keys (all present): p50 / p99
  get4k    single 4 KiB GET: p50 / p99
  put/get  batch_put_from / batch_get_into of 64 x 256 KiB from one numpy buffer: GB/s

ratio = cluster / single (for latencies lower is better, for GB/s higher).
The cluster spreads keys over 3 nodes that share this machine's cores, so the
ratio is the client's overhead plus any parallelism gained or lost.

    .venv/bin/python -m bench.cluster.client_overhead
    .venv/bin/python -m bench.cluster.client_overhead --rounds 300 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import gcache
from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE, ClusterMap
from gcache.tools.devcluster.local_server import LocalServer

NODES = 3
EXISTS_KEYS = 10_000
LATENCY_VALUE_BYTES = 4096
BULK_VALUE_BYTES = 256 * 1024
BULK_BATCH = 64


def percentile_us(samples_s: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples_s), q) * 1e6)


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def run_workloads(client, tag: str, rounds: int, bulk_s: float) -> dict:
    keys = [f"{tag}/exists-{i}".encode() for i in range(EXISTS_KEYS)]
    small = os.urandom(64)
    for lo in range(0, EXISTS_KEYS, 2000):
        assert all(client.put_batch(keys[lo : lo + 2000], [small] * len(keys[lo : lo + 2000])))
    assert all(client.batch_is_exist(keys))
    exists = timed(lambda: client.batch_is_exist(keys), rounds)

    latency_key = f"{tag}/latency".encode()
    assert client.put(latency_key, os.urandom(LATENCY_VALUE_BYTES))
    for _ in range(50):
        client.get(latency_key)
    get4k = timed(lambda: client.get(latency_key), rounds * 10)

    bulk_keys = [f"{tag}/bulk-{i}".encode() for i in range(BULK_BATCH)]
    src = np.frombuffer(os.urandom(BULK_VALUE_BYTES * BULK_BATCH), dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = [i * BULK_VALUE_BYTES for i in range(BULK_BATCH)]
    sizes = [BULK_VALUE_BYTES] * BULK_BATCH
    batch_bytes = BULK_VALUE_BYTES * BULK_BATCH

    def gbps(fn) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < bulk_s:
            fn()
            n += 1
        return n * batch_bytes / (time.perf_counter() - t0) / 1e9

    put = gbps(lambda: client.batch_put_from(bulk_keys, src, sizes=sizes, offsets=offsets))
    get = gbps(lambda: client.batch_get_into(bulk_keys, dst, sizes=sizes, offsets=offsets))
    assert np.array_equal(src, dst), "batch_get_into returned different bytes"
    return {
        "exists_p50_us": percentile_us(exists, 50),
        "exists_p99_us": percentile_us(exists, 99),
        "get4k_p50_us": percentile_us(get4k, 50),
        "get4k_p99_us": percentile_us(get4k, 99),
        "put_gbps": put,
        "get_gbps": get,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200, help="exists calls (GETs: 10x this)")
    ap.add_argument("--bulk-s", type=float, default=2.0, help="seconds per put/get GB/s run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gcache-cluster-overhead-") as tmp:
        servers = []
        try:
            for i in range(NODES):
                servers.append(LocalServer(Path(tmp) / f"node{i}", memory="512MiB", disk="0").start())
            cmap = ClusterMap.from_dict(
                {
                    "epoch": 1,
                    "nodes": [
                        {"id": f"node-{i}", "address": s.address, "weight": 1, "state": ACTIVE}
                        for i, s in enumerate(servers)
                    ],
                }
            )
            with gcache.Client(servers[0].address, timeout_s=10) as single:
                single_res = run_workloads(single, "single", args.rounds, args.bulk_s)
            with ClusterClient(initial_map=cmap, timeout_s=10) as cluster:
                cluster_res = run_workloads(cluster, "cluster", args.rounds, args.bulk_s)
        finally:
            for s in servers:
                s.kill()

    rows = {
        name: {
            "single": single_res[name],
            "cluster": cluster_res[name],
            "ratio": cluster_res[name] / single_res[name] if single_res[name] else None,
        }
        for name in single_res
    }
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'measure':<16}{'single':>12}{'cluster':>12}{'ratio':>8}")
    for name, row in rows.items():
        print(f"{name:<16}{row['single']:>12.2f}{row['cluster']:>12.2f}{row['ratio']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
