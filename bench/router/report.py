"""Tables of bench/router/policies.py: median [min..max] over seeds, least_load beside every policy,
ratios to it taken per seed (same workload, same arrivals) and then summarised."""

from __future__ import annotations

import numpy as np

from bench.common.stats import median_range
from gcache.common.attention import AttentionKind
from gcache.common.units import MiB
from gcache.worker.kvcache.kv_pool import DualKVCache

BASE, OURS = "least_load", "cache_aware"
OURS_ALL = ("cache_aware", "cache_ttft")  # the seed's score (default) and the estimated-TTFT cost
HIT_GAIN_MIN, IMBALANCE_MAX = 1.35, 1.25


def pct(x) -> str:
    return f"{x:.1%}"


def sec(x) -> str:
    return f"{x:.2f}s"


def num(x) -> str:
    return f"{x:.2f}"


def ratio(x) -> str:
    return f"{x:.2f}x"


def rate(x) -> str:
    return f"{x:,.0f}"


def print_workload(name, seeds_at, workers, policies, results, st) -> None:
    cfg, args = st["cfg"][name], st["args"]
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    tiers = "L1 + L2 + shared L3 (gcache-server)" if args.l3 else "L1 + L2 per worker, no L3"
    print(
        f"\n=== {name}: W={cfg.window}, page {cfg.page_size} tokens, KV bytes/page full {bf} SWA {bs}; {tiers}; "
        f"Poisson arrivals {st['rate'][name]}/s per worker x load scale {', '.join(f'{x:g}' for x in seeds_at)} "
        f"(a turn waits for the previous one); "
        f"publish + refresh every {args.tick_s}s virtual; {args.routers} router(s)"
    )
    all_seeds = sorted(set().union(*seeds_at.values()))
    for w in workers:
        for seed in all_seeds:
            i, b = st["info"][(name, seed, w)], st["budgets"][(name, seed, w)]
            raised = " (raised to fit the longest request)" if i["l1_raised"] else ""
            print(
                f"  {w} workers, seed {seed}: {i['requests']} requests ({i['conversations']} conversations), "
                f"{i['prompt_tokens']:,} prompt tokens, working set {i['pages']:,} pages = "
                f"{i['ws_bytes'] / MiB:.1f} MiB full KV; infinite single cache hit {i['oracle_hit']:.1%}; "
                f"per worker L1 {b.l1_bytes / MiB:.1f} MiB{raised}, L2 {b.l2_bytes / MiB:.1f} MiB"
            )
    head = (
        f"  {'policy':<12} {'token hit':>22} {'l1':>6} {'l2':>6} {'l3':>6} {'TTFT P50':>22} {'TTFT P90':>22} "
        f"{'tok/s':>7} {'cap tok/s':>9} {'util':>5} {'load':>5} {'imbalance':>19} {'work imb':>8} {'SWA-lost':>8} {'misroute':>8} "
        f"{'hit/LL':>19} {'P90/LL':>19}"
    )
    for w, scale in st["points"]:
        seeds = seeds_at[scale]
        print(
            f"\n {name}, {w} workers, load x{scale:g} = {st['rate'][name] * scale:g} requests/s per worker  "
            f"(median [min..max] over seeds {seeds}; /LL = ratio to {BASE}, per seed)"
        )
        print(head)
        for p in policies:
            rs = [results[(name, s, p, w, scale)] for s in seeds]
            base = [results.get((name, s, BASE, w, scale)) for s in seeds]
            t = [f"{np.median([r.tier_hit(x) for r in rs]):6.1%}" for x in ("l1", "l2", "l3")]
            hit_ll = p90_ll = "-"
            if all(base):
                hit_ll = median_range([r.hit / max(b.hit, 1e-9) for r, b in zip(rs, base)], ratio)
                p90_ll = median_range([r.ttft(90) / b.ttft(90) for r, b in zip(rs, base)], ratio)
            print(
                f"  {p:<12} {median_range([r.hit for r in rs], pct):>22} {' '.join(t)} "
                f"{median_range([r.ttft(50) for r in rs], sec):>22} {median_range([r.ttft(90) for r in rs], sec):>22} "
                f"{np.median([r.throughput for r in rs]):>7,.0f} {np.median([r.capacity for r in rs]):>9,.0f} "
                f"{np.median([r.utilisation for r in rs]):>5.0%} "
                f"{np.median([r.mean_load for r in rs]):>5.1f} {median_range([r.imbalance for r in rs], num):>19} {np.median([r.work_imbalance for r in rs]):>8.2f} "
                f"{int(np.median([r.swa_lost_routes for r in rs])):>8} {int(np.median([r.misroutes for r in rs])):>8} "
                f"{hit_ll:>19} {p90_ll:>19}"
            )
    walls = [r.wall_s for k, r in results.items() if k[0] == name]
    print(
        f"  (tok/s: prompt + generated tokens / makespan, arrival-bound; cap tok/s: prompt tokens per busy "
        f"worker-second, what the workers could take at saturation; util: busy worker-seconds / (workers x makespan); load: mean requests on a worker (running + waiting) while any is busy; imbalance: time-averaged max / mean of "
        f"requests on a worker (running + waiting), sampled every tick; work imb: max / mean busy seconds per worker over the run; SWA-lost: routes to a worker holding "
        f"more full-KV prefix than it could use (SWA evicted); misroute: those where another worker held a "
        f"longer window-safe prefix; run wall time {min(walls):.1f}..{max(walls):.1f}s)"
    )


def print_targets(out: dict, names, seeds_at, workers, policies, st) -> dict:
    runs = out["runs"]
    verdicts = {}
    print("\n=== targets (medians over seeds), per load point")
    ours_all = [p for p in OURS_ALL if p in policies]
    if not ours_all:
        print(f"  {OURS} did not run")
        return verdicts
    for ours in ours_all:
        for name, (w, scale) in ((n, pt) for n in names for pt in st["points"]):
            seeds = seeds_at[scale]
            med = lambda p, f: float(np.median([f(runs[(name, s, p, w, scale)]) for s in seeds]))
            at = f"{name}, {w} workers, load x{scale:g}"
            tag = f"{name}_{w}_x{scale:g}_{ours}"
            if BASE in policies:
                gain = float(
                    np.median(
                        [
                            runs[(name, s, ours, w, scale)].hit / max(runs[(name, s, BASE, w, scale)].hit, 1e-9)
                            for s in seeds
                        ]
                    )
                )
                imb = med(ours, lambda r: r.imbalance)
                ok = gain >= HIT_GAIN_MIN and imb <= IMBALANCE_MAX
                verdicts[f"hit_gain_{tag}"] = ok
                print(
                    f"  {at}: hit {ours} {med(ours, lambda r: r.hit):.1%} vs {BASE} "
                    f"{med(BASE, lambda r: r.hit):.1%} = {gain:.2f}x (>= {HIT_GAIN_MIN}x), imbalance {imb:.2f} "
                    f"(<= {IMBALANCE_MAX}; {BASE} {med(BASE, lambda r: r.imbalance):.2f})"
                    f"  -> {'MET' if ok else 'NOT MET'}"
                )
            mine = med(ours, lambda r: r.ttft(90))
            others = {p: med(p, lambda r: r.ttft(90)) for p in policies if p not in OURS_ALL}
            ok = all(mine < v for v in others.values())
            verdicts[f"p90_best_{tag}"] = ok
            print(
                f"  {at}: TTFT P90 {ours} {mine:.2f}s vs "
                + ", ".join(f"{p} {v:.2f}s" for p, v in others.items())
                + f"  -> {'MET' if ok else 'NOT MET'}"
            )
    case = out.get("swa_case")
    if case:
        ok = case["met"]
        verdicts["swa_misroute_case"] = ok
        print(f"  SWA mis-routing case: {case['summary']}  -> {'SHOWN' if ok else 'NOT SHOWN'}")
    return verdicts
