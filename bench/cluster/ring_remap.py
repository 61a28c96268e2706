"""How many keys change owner when a node joins or leaves: ketama ring vs modulo.

For each cluster size N, builds the cluster map the master would publish and
the client's Placement from it (gcache.cluster.placement), over content-addressed
page keys like SGLang HiCache's (chained sha256 hex, through gcache.wire.keys), then:

  join   N -> N+1: the new node enters as `joining`; ideal moved fraction 1/(N+1).
  leave  N -> N-1: each node in turn drains; ideal 1/N (that node's share);
         reported as the mean over nodes and the worst node.

Side by side: modulo placement (sha256(key) % N over the sorted node list,
what InfiniStore does) on the same change. Also checked, per change:
  violations  keys that moved between two nodes that both stayed (a join may
              only move keys *to* the new node, a leave only *from* the leaving one);
  fallback    keys whose dual-read fallback (Placement.fallback) is not the
              owner before the change: a read of them during the migration would
              miss although the old owner still has them.
Both should be 0 for equal weights. `--weights mixed` runs the same with node
weights alternating 1x and 2x (ring weight = capacity in GiB), where the new
node's weight differs from the mean: uhashring scales every node's virtual
node count by N / total weight, so a membership change also moves points of
nodes that stayed, and the violations column shows how many keys that costs.

    .venv/bin/python -m bench.cluster.ring_remap   # N = 3, 5, 8, 16; 100k keys
    .venv/bin/python -m bench.cluster.ring_remap --nodes 4,32 --keys 20000 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from statistics import mean

from gcache.cluster.cluster_map import ACTIVE, DRAINING, JOINING, ClusterMap
from gcache.cluster.placement import Placement
from gcache.wire.keys import KeyBuilder, get_hash_str

GIB_PER_WEIGHT_UNIT = 1088  # a node with 64 GiB memory + 1 TiB disk: weight 1088 (one per GiB)
PAGES_PER_SEQUENCE = 64  # keys come in chained runs, like the pages of one prompt
PAGE_TOKENS = 16


def page_keys(count: int, seed: int = 0) -> list[bytes]:
    """`count` store keys of SGLang-style chained page hashes, deterministic in `seed`."""
    builder = KeyBuilder(model="Qwen/Qwen3-8B")
    keys: list[bytes] = []
    seq = 0
    while len(keys) < count:
        prior = None
        for page in range(min(PAGES_PER_SEQUENCE, count - len(keys))):
            base = (seed * 1_000_003 + seq * PAGES_PER_SEQUENCE + page) * PAGE_TOKENS
            prior = get_hash_str(range(base, base + PAGE_TOKENS), prior)
            keys.append(builder.key(prior))
        seq += 1
    return keys


def node_id(i: int) -> str:
    return f"gpu-node-{i:02d}"


def weight_of(i: int, mode: str) -> int:
    return GIB_PER_WEIGHT_UNIT * (2 if mode == "mixed" and i % 2 else 1)


def cluster_map(count: int, mode: str, state_of=lambda i: ACTIVE) -> ClusterMap:
    return ClusterMap.from_dict(
        {
            "epoch": 1,
            "nodes": [
                {
                    "id": node_id(i),
                    "address": f"10.0.0.{i + 1}:7600",
                    "weight": weight_of(i, mode),
                    "state": state_of(i),
                }
                for i in range(count)
            ],
        }
    )


def modulo_owners(digests: list[int], node_ids: list[str]) -> list[str]:
    ids = sorted(node_ids)
    return [ids[d % len(ids)] for d in digests]


def moved_fraction(before: list, after: list) -> float:
    return sum(a != b for a, b in zip(before, after)) / len(before)


def measure_change(keys, before: list[str], placement: Placement, node: str, kind: str) -> dict:
    """Moved fraction, violations and fallback misses for one join or leave of `node`."""
    after = placement.write.owners(keys)
    moved = violations = fallback_wrong = 0
    for key, old, new in zip(keys, before, after):
        if old == new:
            continue
        moved += 1
        if (kind == "join" and new != node) or (kind == "leave" and old != node):
            violations += 1
        if placement.fallback(key, new) != old:
            fallback_wrong += 1
    return {"moved": moved / len(keys), "violations": violations, "fallback_wrong": fallback_wrong}


def measure_size(keys, digests, count: int, mode: str) -> dict:
    base = Placement(cluster_map(count, mode))
    before = base.write.owners(keys)
    ids = [node_id(i) for i in range(count)]
    shares = [before.count(n) / len(keys) for n in ids]
    total_weight = sum(weight_of(i, mode) for i in range(count))
    balance = max(s * total_weight / weight_of(i, mode) for i, s in enumerate(shares))
    mod_before = modulo_owners(digests, ids)

    newcomer = node_id(count)
    joined = cluster_map(count + 1, mode, lambda i: JOINING if i == count else ACTIVE)
    join = measure_change(keys, before, Placement(joined), newcomer, "join")
    join["ideal"] = weight_of(count, mode) / (total_weight + weight_of(count, mode))
    join["modulo"] = moved_fraction(mod_before, modulo_owners(digests, ids + [newcomer]))

    leaves = []
    for i in range(count):
        drained = cluster_map(count, mode, lambda j: DRAINING if j == i else ACTIVE)
        one = measure_change(keys, before, Placement(drained), ids[i], "leave")
        one["ideal"] = weight_of(i, mode) / total_weight
        one["modulo"] = moved_fraction(mod_before, modulo_owners(digests, ids[:i] + ids[i + 1 :]))
        leaves.append(one)
    leave = {
        "ideal": mean(x["ideal"] for x in leaves),
        "moved": mean(x["moved"] for x in leaves),
        "moved_worst": max(x["moved"] for x in leaves),
        "ratio_worst": max(x["moved"] / x["ideal"] for x in leaves),
        "modulo": mean(x["modulo"] for x in leaves),
        "violations": sum(x["violations"] for x in leaves),
        "fallback_wrong": sum(x["fallback_wrong"] for x in leaves),
    }
    join["ratio"] = join["moved"] / join["ideal"]
    leave["ratio"] = mean(x["moved"] / x["ideal"] for x in leaves)
    # balance: the most loaded node's share over its fair (weight-proportional) share
    return {"nodes": count, "weights": mode, "balance_max_over_mean": balance, "join": join, "leave": leave}


def print_table(rows: list[dict], key_count: int) -> None:
    print(f"{key_count} keys. ideal: the changed node's share (join 1/(N+1), leave 1/N at equal weights);")
    print("leave: mean over each node leaving in turn, worst: the worst node; violations and fallback:")
    print("keys summed over every change (should be 0); balance: most loaded node / its fair share.")
    head = (
        "weights",
        "N",
        "change",
        "ideal",
        "ring",
        "ring/ideal",
        "worst",
        "worst/ideal",
        "modulo",
        "violations",
        "fallback",
        "balance",
    )
    fmt = "{:<8}{:>4}  {:<7}{:>7}{:>8}{:>11}{:>8}{:>12}{:>8}{:>11}{:>9}{:>9}"
    print(fmt.format(*head))
    for r in rows:
        for kind in ("join", "leave"):
            c = r[kind]
            worst = f"{c['moved_worst']:.3f}" if kind == "leave" else ""
            worst_ratio = f"{c['ratio_worst']:.2f}" if kind == "leave" else ""
            print(
                fmt.format(
                    r["weights"],
                    r["nodes"],
                    kind,
                    f"{c['ideal']:.3f}",
                    f"{c['moved']:.3f}",
                    f"{c['ratio']:.2f}",
                    worst,
                    worst_ratio,
                    f"{c['modulo']:.3f}",
                    c["violations"],
                    c["fallback_wrong"],
                    f"{r['balance_max_over_mean']:.2f}" if kind == "join" else "",
                )
            )


def size_list(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nodes takes comma-separated integers, got {text!r}") from None
    if not sizes or any(not 2 <= n <= 256 for n in sizes):
        raise argparse.ArgumentTypeError("--nodes values must be 2..256 (a leave needs one node left)")
    return sizes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=size_list, default=[3, 5, 8, 16], help="cluster sizes N (default 3,5,8,16)")
    p.add_argument("--keys", type=int, default=100_000, help="keys to place (default 100000)")
    p.add_argument(
        "--weights",
        default="equal,mixed",
        help="equal, mixed (alternating 1x/2x capacity) or both, comma-separated (default both)",
    )
    p.add_argument("--seed", type=int, default=0, help="key set seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.weights.split(",") if m.strip()]
    if not modes or set(modes) - {"equal", "mixed"}:
        p.error(f"--weights takes equal and/or mixed, got {args.weights!r}")
    if not 1000 <= args.keys <= 10_000_000:
        p.error("--keys must be 1000..10000000")

    keys = page_keys(args.keys, args.seed)
    digests = [int.from_bytes(hashlib.sha256(k).digest(), "big") for k in keys]
    rows = [measure_size(keys, digests, n, mode) for mode in modes for n in args.nodes]
    if args.json:
        json.dump({"keys": args.keys, "seed": args.seed, "rows": rows}, sys.stdout, indent=2)
        print()
    else:
        print_table(rows, args.keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
