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
import random
import sys
from hashlib import md5
from statistics import mean

from gcache.cluster.cluster_map import (
    ACTIVE,
    DRAINING,
    JOINING,
    PREVIOUS_STATES,
    WRITE_STATES,
    ClusterMap,
    PlacementKind,
)
from gcache.cluster.placement import VNODES, Placement, Ring
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
    if mode == "random":  # hosts of 0.25x..4x the usual capacity, fixed per index
        return max(1, int(GIB_PER_WEIGHT_UNIT * 2 ** random.Random(i * 7919 + 1).uniform(-2, 2)))
    return GIB_PER_WEIGHT_UNIT * (2 if mode == "mixed" and i % 2 else 1)


# Placements compared: the map's two kinds, and ketama with points proportional to
# each node's own weight (VNODES per OWN_WEIGHT_REF of weight, at least one), which
# no map names: measured here only.
KINDS = ("ketama", "ketama-own", "rendezvous")
OWN_WEIGHT_REF = 1024


def own_weight_points(weights: dict[str, int]) -> dict[int, str]:
    ring: dict[int, str] = {}
    for nid, weight in weights.items():
        for v in range(max(1, round(VNODES * weight / OWN_WEIGHT_REF))):
            digest = md5(f"{nid}-{v}".encode()).digest()
            for r in range(0, 16, 4):
                ring[int.from_bytes(digest[r : r + 4], "little")] = nid
    return ring


class OwnWeightPlacement(Placement):
    """Placement with a ketama ring whose points per node depend on its weight alone."""

    def __init__(self, cmap: ClusterMap):
        super().__init__(cmap)
        ring = lambda ws: Ring(ws, points_of=own_weight_points)  # noqa: E731
        write = {n.id: n.weight for n in cmap.in_states(WRITE_STATES)}
        previous = {n.id: n.weight for n in cmap.in_states(PREVIOUS_STATES)}
        self.write = ring(write)
        self.previous = self.write if previous == write else ring(previous)


def placement_for(cmap: ClusterMap, kind: str) -> Placement:
    if kind == "ketama-own":
        return OwnWeightPlacement(cmap)
    return Placement(cmap._replace(placement=PlacementKind(kind)))


def cluster_map(count: int, mode: str, state_of=lambda i: ACTIVE, weight=weight_of) -> ClusterMap:
    return ClusterMap.from_dict(
        {
            "epoch": 1,
            "nodes": [
                {
                    "id": node_id(i),
                    "address": f"10.0.0.{i + 1}:7600",
                    "weight": weight(i, mode),
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
    """Moved fraction, violations and fallback misses for one join, leave or reweight of `node`."""
    after = placement.write.owners(keys)
    moved = violations = fallback_wrong = 0
    for key, old, new in zip(keys, before, after):
        if old == new:
            continue
        moved += 1
        if (kind == "join" and new != node) or (kind == "leave" and old != node) or (node not in (old, new)):
            violations += 1
        if kind != "reweight" and placement.fallback(key, new) != old:
            fallback_wrong += 1
    return {"moved": moved / len(keys), "violations": violations, "fallback_wrong": fallback_wrong}


def summarize(changes: list[dict]) -> dict:
    return {
        "ideal": mean(x["ideal"] for x in changes),
        "moved": mean(x["moved"] for x in changes),
        "moved_worst": max(x["moved"] for x in changes),
        "ratio": mean(x["moved"] / x["ideal"] for x in changes),
        "ratio_worst": max(x["moved"] / x["ideal"] for x in changes),
        "modulo": mean(x.get("modulo", 0.0) for x in changes),
        "violations": sum(x["violations"] for x in changes),
        "fallback_wrong": sum(x["fallback_wrong"] for x in changes),
    }


def measure_size(keys, digests, count: int, mode: str, kind: str = "ketama") -> dict:
    base = placement_for(cluster_map(count, mode), kind)
    before = base.write.owners(keys)
    ids = [node_id(i) for i in range(count)]
    shares = [before.count(n) / len(keys) for n in ids]
    total_weight = sum(weight_of(i, mode) for i in range(count))
    balance = max(s * total_weight / weight_of(i, mode) for i, s in enumerate(shares))
    mod_before = modulo_owners(digests, ids)

    newcomer = node_id(count)
    joined = cluster_map(count + 1, mode, lambda i: JOINING if i == count else ACTIVE)
    join = measure_change(keys, before, placement_for(joined, kind), newcomer, "join")
    join["ideal"] = weight_of(count, mode) / (total_weight + weight_of(count, mode))
    join["modulo"] = moved_fraction(mod_before, modulo_owners(digests, ids + [newcomer]))

    leaves, reweights = [], []
    for i in range(count):
        drained = cluster_map(count, mode, lambda j: DRAINING if j == i else ACTIVE)
        one = measure_change(keys, before, placement_for(drained, kind), ids[i], "leave")
        one["ideal"] = weight_of(i, mode) / total_weight
        one["modulo"] = moved_fraction(mod_before, modulo_owners(digests, ids[:i] + ids[i + 1 :]))
        leaves.append(one)
        # Node i's capacity doubles (even i) or halves (odd i); the others stay.
        factor = 2.0 if i % 2 == 0 else 0.5
        new_weight = max(1, int(weight_of(i, mode) * factor))
        reweighted = cluster_map(count, mode, weight=lambda j, m: new_weight if j == i else weight_of(j, m))
        one = measure_change(keys, before, placement_for(reweighted, kind), ids[i], "reweight")
        new_total = total_weight - weight_of(i, mode) + new_weight
        one["ideal"] = abs(new_weight / new_total - weight_of(i, mode) / total_weight)
        reweights.append(one)
    join.update(moved_worst=join["moved"], ratio=join["moved"] / join["ideal"])
    join["ratio_worst"] = join["ratio"]
    # balance: the most loaded node's share over its fair (weight-proportional) share
    return {
        "nodes": count,
        "weights": mode,
        "placement": kind,
        "balance_max_over_mean": balance,
        "join": join,
        "leave": summarize(leaves),
        "reweight": summarize(reweights),
    }


def print_table(rows: list[dict], key_count: int) -> None:
    print(f"{key_count} keys. ideal: the changed node's share (join 1/(N+1), leave 1/N at equal weights;")
    print("reweight: each node in turn doubles (even) or halves (odd) its weight, ideal = its share's change);")
    print("leave/reweight: mean over the nodes, worst: the worst node; violations and fallback: keys summed")
    print("over every change (should be 0); balance: most loaded node / its fair share.")
    print("placement: ketama = the old ring (maps without a placement field), ketama-own = points per node")
    print("from its own weight only, rendezvous = weighted rendezvous hashing (the new maps' placement).")
    head = (
        "weights",
        "N",
        "placement",
        "change",
        "ideal",
        "moved",
        "ratio",
        "worst",
        "worst/ideal",
        "modulo",
        "violations",
        "fallback",
        "balance",
    )
    fmt = "{:<8}{:>4}  {:<11}{:<9}{:>7}{:>8}{:>7}{:>8}{:>12}{:>8}{:>11}{:>9}{:>9}"
    print(fmt.format(*head))
    for r in rows:
        for change in ("join", "leave", "reweight"):
            c = r[change]
            print(
                fmt.format(
                    r["weights"],
                    r["nodes"],
                    r["placement"],
                    change,
                    f"{c['ideal']:.3f}",
                    f"{c['moved']:.3f}",
                    f"{c['ratio']:.2f}",
                    f"{c['moved_worst']:.3f}",
                    f"{c['ratio_worst']:.2f}",
                    f"{c['modulo']:.3f}" if change != "reweight" else "",
                    c["violations"],
                    c["fallback_wrong"] if change != "reweight" else "",
                    f"{r['balance_max_over_mean']:.2f}" if change == "join" else "",
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
        default="equal,mixed,random",
        help="equal, mixed (alternating 1x/2x capacity), random (0.25x..4x), comma-separated (default all)",
    )
    p.add_argument(
        "--placement",
        default=",".join(KINDS),
        help=f"placements to compare, comma-separated from {','.join(KINDS)} (default all)",
    )
    p.add_argument("--seed", type=int, default=0, help="key set seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.weights.split(",") if m.strip()]
    if not modes or set(modes) - {"equal", "mixed", "random"}:
        p.error(f"--weights takes equal, mixed and/or random, got {args.weights!r}")
    kinds = [k.strip() for k in args.placement.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--placement takes {', '.join(KINDS)}, got {args.placement!r}")
    if not 1000 <= args.keys <= 10_000_000:
        p.error("--keys must be 1000..10000000")

    keys = page_keys(args.keys, args.seed)
    digests = [int.from_bytes(hashlib.sha256(k).digest(), "big") for k in keys]
    rows = [measure_size(keys, digests, n, mode, kind) for mode in modes for n in args.nodes for kind in kinds]
    if args.json:
        json.dump({"keys": args.keys, "seed": args.seed, "rows": rows}, sys.stdout, indent=2)
        print()
    else:
        print_table(rows, args.keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
