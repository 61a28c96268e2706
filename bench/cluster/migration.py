"""Cluster figures on a local cluster: failover times, remapping, migration, hit rates.

Starts `gcache-cluster`-style masters and nodes on loopback addresses, loads
content-addressed values through gcache.ClusterClient, and measures:

  - leader takeover: kill -9 the master leader, time until another replica leads;
  - dead marking: kill -9 a node, time until the map says dead;
  - keys remapped by a join and by a leave (measured on the loaded keys, beside
    the ideal 1/N and the bound 1.25/N the issue sets);
  - drain: hit rate of every loaded key before and after, the share of the
    drained node's keys still readable, and the migration throughput;
  - join: the hit rate of a steady read workload before the join, during the
    migration window, and after the new node is active.

  .venv/bin/python -m bench.cluster.migration [--nodes 4] [--keys 4000] [--value-kib 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import threading
import time

import numpy as np

from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE, DEAD
from gcache.cluster.placement import Placement
from gcache.tools.devcluster.local_cluster import LocalCluster
from gcache.tools.storebench.limits import loopback_tcp_gbps


def make_value(i: int, size: int) -> bytes:
    return np.random.default_rng(i).bytes(size)


def read_hits(client, keys, size: int) -> tuple[int, int]:
    """(hits, wrong) reading every key in batches into one buffer."""
    buf = bytearray(size * 256)
    hits = wrong = 0
    for lo in range(0, len(keys), 256):
        part = keys[lo : lo + 256]
        got = client.batch_get_into(part, buf, [size] * len(part), [j * size for j in range(len(part))])
        for j, n in enumerate(got):
            if n is None:
                continue
            hits += 1
            index = int(part[j].split(b"/")[-1])
            if buf[j * size : (j + 1) * size] != make_value(index, size):
                wrong += 1
    return hits, wrong


PUSH_LINE = re.compile(r"pushed (\d+) \(([\d.]+) MB\).*?([\d.]+) s, ([\d.]+) MB/s")


def pushed_mb_per_s(log_path: str) -> float | None:
    """The node's own figure for its largest rebalance: MB pushed / seconds spent pushing."""
    try:
        runs = [m.groups() for m in PUSH_LINE.finditer(open(log_path, errors="replace").read())]
    except OSError:
        return None
    runs = [r for r in runs if int(r[0]) > 0]
    return float(max(runs, key=lambda r: float(r[1]))[3]) if runs else None


def moved_fraction(before: Placement, after: Placement, keys) -> float:
    return sum(before.owner(k) != after.owner(k) for k in keys) / len(keys)


class SteadyReader(threading.Thread):
    """Reads random loaded keys in small batches; hit rate per labelled phase."""

    def __init__(self, client, keys, seed: int):
        super().__init__(daemon=True)
        self.client, self.keys, self.rng = client, keys, random.Random(seed)
        self.phase = "before"
        self.counts: dict[str, list[int]] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            part = self.rng.sample(self.keys, 32)
            phase = self.phase
            got = self.client.batch_is_exist(part)
            c = self.counts.setdefault(phase, [0, 0])
            c[0] += sum(got)
            c[1] += len(got)

    def rate(self, phase: str) -> float | None:
        hits, total = self.counts.get(phase, [0, 0])
        return hits / total if total else None


def time_leader_takeover(cluster, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        leader = cluster.wait_leader()
        started = time.monotonic()
        cluster.kill(leader)
        cluster.wait_leader()
        times.append(time.monotonic() - started)
        cluster.start(leader)
        time.sleep(1.0)
    return times


def time_dead_marking(cluster, repeat: int) -> list[float]:
    times = []
    for i in range(repeat):
        node = cluster.nodes[i % len(cluster.nodes)]
        started = time.monotonic()
        cluster.kill(node)
        cluster.wait_map(lambda m: (n := m.node(node.id)) is not None and n.state == DEAD, 60, "dead")
        times.append(time.monotonic() - started)
        cluster.start(node)
        cluster.wait_active([node.id], 60)
    return times


def run(args) -> dict:
    size = args.value_kib * 1024
    report: dict = {
        "nodes": args.nodes,
        "keys": args.keys,
        "value_bytes": size,
        "loopback_tcp_mb_per_s": loopback_tcp_gbps() * 1000,
    }  # the physical limit
    with tempfile.TemporaryDirectory(prefix="gcache-cluster-bench-") as tmp:
        cluster = LocalCluster(
            tmp,
            masters=3,
            nodes=args.nodes,
            memory=args.memory,
            disk=args.disk,
            heartbeat_interval_s=args.heartbeat_interval_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            migration_timeout_s=120,
        )
        cluster.up()
        client = ClusterClient(cluster.client_url, timeout_s=2.0, map_refresh_s=0.5)
        try:
            report["leader_takeover_s"] = time_leader_takeover(cluster, args.repeat)
            report["dead_marked_s"] = time_dead_marking(cluster, args.repeat)
            cluster.wait_map(lambda m: all(n.state == ACTIVE for n in m.nodes), 60, "all active")
            client.refresh_map()

            keys = [f"bench/{i}".encode() for i in range(args.keys)]
            for lo in range(0, len(keys), 128):
                client.put_batch(
                    keys[lo : lo + 128], [make_value(i, size) for i in range(lo, min(lo + 128, len(keys)))]
                )
            before_map = cluster.current_map()
            before = Placement(before_map)
            hits, wrong = read_hits(client, keys, size)
            report["drain_hit_rate_before"] = hits / len(keys)

            # -- drain one node --------------------------------------------------
            victim = cluster.nodes[0]
            victim_keys = [k for k in keys if before.owner(k) == victim.id]
            started = time.monotonic()
            cluster.master_client().call("Drain", {"node_id": victim.id})
            after_map = cluster.wait_map(lambda m: m.node(victim.id) is None, 300, "drained")
            drain_s = time.monotonic() - started
            cluster.stop(victim)
            report["drain_push_mb_per_s"] = pushed_mb_per_s(victim.log)
            client.refresh_map()
            after = Placement(after_map)
            report["leave_moved_fraction"] = moved_fraction(before, after, keys)
            report["leave_ideal_fraction"] = 1 / args.nodes
            report["drain_s"] = drain_s
            report["drain_mb_per_s"] = len(victim_keys) * size / drain_s / 1e6
            hits, wrong2 = read_hits(client, keys, size)
            report["drain_hit_rate_after"] = hits / len(keys)
            report["drained_keys_readable"] = read_hits(client, victim_keys, size)[0] / max(1, len(victim_keys))

            # -- join a node under a steady read workload -----------------------------
            live_keys = [k for k, v in zip(keys, client.batch_is_exist(keys)) if v]
            reader = SteadyReader(client, live_keys, seed=7)
            reader.start()
            time.sleep(args.phase_s)
            pre_join = Placement(cluster.current_map())
            reader.phase = "during"
            started = time.monotonic()
            node = cluster.add_node(wait_active=False)
            joined = cluster.wait_active([node.id], 300)
            report["join_migration_s"] = time.monotonic() - started
            reader.phase = "after"
            time.sleep(args.phase_s)
            reader.stop_event.set()
            reader.join(30)
            report["join_moved_fraction"] = moved_fraction(pre_join, Placement(joined), live_keys)
            report["join_ideal_fraction"] = 1 / args.nodes
            for phase in ("before", "during", "after"):
                report[f"join_hit_rate_{phase}"] = reader.rate(phase)
            report["wrong_bytes"] = wrong + wrong2
            report["client"] = client.client_stats()
        finally:
            client.close()
            cluster.down()
    return report


def render(r: dict) -> str:
    med = statistics.median
    n = r["nodes"]
    lines = [
        f"cluster: 3 masters, {n} nodes, {r['keys']} keys x {r['value_bytes'] // 1024} KiB",
        f"leader takeover after kill -9: median {med(r['leader_takeover_s']):.2f}s  all {r['leader_takeover_s']}",
        f"dead node marked after kill -9: median {med(r['dead_marked_s']):.2f}s  all {r['dead_marked_s']}",
        f"keys remapped by a leave ({n}->{n - 1}): {r['leave_moved_fraction']:.4f}  ideal 1/N {r['leave_ideal_fraction']:.4f}"
        f"  ratio {r['leave_moved_fraction'] / r['leave_ideal_fraction']:.2f} (bound 1.25)",
        f"keys remapped by a join ({n - 1}->{n}): {r['join_moved_fraction']:.4f}  ideal 1/N {r['join_ideal_fraction']:.4f}"
        f"  ratio {r['join_moved_fraction'] / r['join_ideal_fraction']:.2f} (bound 1.25)",
        f"drain: {r['drain_s']:.2f}s from the Drain call to the node leaving the map ({r['drain_mb_per_s']:.1f} MB/s of its keys);"
        f" the node's own push rate {r['drain_push_mb_per_s']} MB/s"
        f" = {(r['drain_push_mb_per_s'] or 0) / r['loopback_tcp_mb_per_s']:.3f} of loopback TCP"
        f" ({r['loopback_tcp_mb_per_s']:.0f} MB/s);\n       hit rate before {r['drain_hit_rate_before']:.4f}"
        f" after {r['drain_hit_rate_after']:.4f}; drained node's keys readable {r['drained_keys_readable']:.4f} (goal >= 0.99)",
        f"join: migration window {r['join_migration_s']:.2f}s; steady hit rate before {r['join_hit_rate_before']:.4f}"
        f" during {r['join_hit_rate_during']:.4f} after {r['join_hit_rate_after']:.4f}"
        f" (during/before {r['join_hit_rate_during'] / r['join_hit_rate_before']:.3f}, goal >= 0.95)",
        f"wrong bytes read: {r['wrong_bytes']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--keys", type=int, default=4000)
    p.add_argument("--value-kib", type=int, default=64)
    p.add_argument("--memory", default="512MiB")
    p.add_argument("--disk", default="1GiB")
    p.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    p.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    p.add_argument("--repeat", type=int, default=3, help="kills per timing (median printed)")
    p.add_argument("--phase-s", type=float, default=3.0, help="steady-read seconds before and after the join")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["wrong_bytes"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
