"""Tables of bench/hicache/hierarchy.py: medians over seeds with [min..max], baselines beside, ratios."""

from __future__ import annotations

import numpy as np

from bench.common.stats import median_range
from gcache.common.attention import AttentionKind
from gcache.common.units import MiB
from gcache.worker.kvcache.kv_pool import DualKVCache

OURS, UNAWARE, SGLANG, L1 = "L1+L2+L3", "SWA-unaware", "SGLang-style L1", "L1"


def _pct(x) -> str:
    return f"{x:.1%}"


def _sec(x) -> str:
    return f"{x:.3f}s"


def _pages(cfg, budget: int, ratio: float, unaware: bool) -> str:
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    if unaware:
        n = budget // (bf + bs)
        return f"{n}+{n}"
    f, s = DualKVCache.pages_for_budget(cfg, budget, ratio)
    return f"{f}+{s}"


def print_workload(name, seeds, workers, setups, results, st, args) -> None:
    cfg = st["cfg"][name]
    ckpt = st["budgets"][(name, seeds[0])].checkpoint_pages
    print(
        f"\n=== {name}: W={cfg.window}, SWA checkpoints at request ends and branch points"
        f"{f' and every {ckpt} pages' if ckpt else ''} (SGLang-style: none); rate {st['rate'][name]}/s per worker"
        f" (Poisson; a turn waits for the previous one)"
    )
    for seed in seeds:
        i, b = st["info"][(name, seed)], st["budgets"][(name, seed)]
        print(
            f"seed {seed}: {i['requests']} requests ({i['conversations']} conversations), {i['prompt_tokens']:,} "
            f"prompt tokens, {i['pages']:,} distinct pages = working set {i['ws_bytes'] / MiB:.1f} MiB full KV "
            f"({i['ws_unaware_bytes'] / MiB:.0f} MiB with SWA KV on every page); longest request "
            f"{i['longest_pages']} pages; infinite single cache (oracle) hit {i['oracle_hit']:.1%}"
        )
        disk = int(b.l3_bytes * args.l3_disk_frac)
        raised = " (raised to fit the longest request, SWA-unaware)" if i["l1_raised"] else ""
        print(
            f"  budgets: L1 {b.l1_bytes / MiB:.1f} MiB/worker{raised}"
            f" = full+SWA pages {_pages(cfg, b.l1_bytes, b.l1_swa_full_ratio, False)} "
            f"(unaware {_pages(cfg, b.l1_bytes, 0, True)}); L2 {b.l2_bytes / MiB:.1f} MiB/worker = "
            f"{_pages(cfg, b.l2_bytes, b.l2_swa_full_ratio, False)} (unaware {_pages(cfg, b.l2_bytes, 0, True)}); "
            f"L3 gcache-server --memory {b.l3_bytes / MiB:.1f}MiB --disk {disk / MiB:.1f}MiB, shared"
        )
    hdr = (
        f"  {'configuration':<16} {'token hit':>22} {'l1':>6} {'l2':>6} {'l3':>6} {'TTFT P50':>24} "
        f"{'TTFT P90':>24} {'recomputed':>11} {'L3 B/token':>10} {'L3 SWA/full':>11} {'preempt':>7}"
    )
    for w in workers:
        print(f"\n {name}, {w} worker{'s' if w > 1 else ''}  (median [min..max] over seeds {seeds})")
        print(hdr)
        for su in setups:
            rs = [results[(name, s, su.name, w)] for s in seeds]
            p50 = [np.percentile(r.ttft_s, 50) for r in rs]
            p90 = [np.percentile(r.ttft_s, 90) for r in rs]
            tiers = [f"{np.median([r.tier_hit(t) for r in rs]):6.1%}" for t in ("l1", "l2", "l3")]
            l3b = np.median([r.l3_bytes_per_token for r in rs]) if su.l3 else None
            l3s = np.median([r.l3_swa_pages / max(1, r.l3_full_pages) for r in rs]) if su.l3 else None
            recomputed = int(np.median([r.recomputed for r in rs]))
            print(
                f"  {su.name:<16} {median_range([r.hit for r in rs], _pct):>22} {' '.join(tiers)} "
                f"{median_range(p50, _sec):>24} {median_range(p90, _sec):>24} {recomputed:>11,} "
                f"{(f'{l3b:,.0f}' if l3b is not None else '-'):>10} {(f'{l3s:.2f}' if l3s is not None else '-'):>11} "
                f"{int(np.median([r.preemptions for r in rs])):>7}"
            )
    if any(su.name == OURS for su in setups):
        w = workers[-1]
        rs = [results[(name, s, OURS, w)] for s in seeds]
        print(
            f"  charged copy time, {OURS}, {w} worker(s), summed over workers (median): L2->L1 loads "
            f"{np.median([r.load_s for r in rs]):.3f}s, L3 prefetches {np.median([r.l3_read_s for r in rs]):.3f}s; "
            f"makespan {np.median([r.makespan_s for r in rs]):.0f}s"
        )
    walls = [r.wall_s for k, r in results.items() if k[0] == name]
    print(
        f"  (recomputed: prefill tokens computed, all workers; L3 B/token: distinct bytes written to L3 / tokens "
        f"of the distinct full pages written; L3 SWA/full: SWA pages per full page written; run wall time "
        f"{min(walls):.1f}..{max(walls):.1f}s)"
    )


def print_density(d: dict, cfg) -> None:
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    print(
        f"\n=== cached prefix tokens held per KV byte, long contexts: {len(d['contexts'])} conversations of "
        f"{min(d['contexts']):,}..{max(d['contexts']):,} tokens, {d['turns']} turns; budgets large enough "
        f"that nothing is evicted; tokens = prefix a request could load from that tier alone"
    )
    print(
        f"  {'tier':<5} {'checkpointed tok':>16} {'bytes':>10} {'tok/MiB':>8}   {'SWA-unaware tok':>15} "
        f"{'bytes':>10} {'tok/MiB':>8}   {'ratio':>6}"
    )
    d["ratios"] = {}
    for tier in ("L1", "L2", "L3"):
        (t1, b1), (t2, b2) = d["checkpointed"][tier], d["SWA-unaware"][tier]
        r1, r2 = t1 / max(1, b1) * MiB, t2 / max(1, b2) * MiB
        d["ratios"][tier] = r1 / r2 if r2 else float("inf")
        print(
            f"  {tier:<5} {t1:>16,} {b1 / MiB:>8.1f}Mi {r1:>8.1f}   {t2:>15,} {b2 / MiB:>8.1f}Mi {r2:>8.1f}   "
            f"{d['ratios'][tier]:>5.2f}x"
        )
    print(
        f"  (upper bound without any SWA KV: (full + SWA) / full page bytes = {(bf + bs) / bf:.2f}x; each "
        f"checkpoint keeps ~{-(-cfg.window // cfg.page_size) + 1} SWA pages)"
    )


def print_targets(out: dict, names, seeds, workers, setups) -> dict:
    runs, info = out["runs"], out["info"]
    have = {s.name for s in setups}
    verdicts = {}
    print("\n=== targets")
    if "density" in out:
        r = out["density"]["ratios"]
        ok = all(v >= 5 for v in r.values())
        verdicts["density_5x"] = ok
        print(
            "  prefix tokens per KV byte vs SWA-unaware at 8K+ contexts >= 5x: "
            + ", ".join(f"{t} {v:.2f}x" for t, v in r.items())
            + f"  -> {'MET' if ok else 'NOT MET'}"
        )
    if {OURS, UNAWARE, SGLANG} <= have:
        for name in names:
            for w in workers:
                med = lambda s: float(np.median([runs[(name, sd, s, w)].hit for sd in seeds]))
                o, u, g, l1 = med(OURS), med(UNAWARE), med(SGLANG), med(L1)
                ok = o > u and o > g
                verdicts[f"hit_vs_baselines_{name}_{w}"] = ok
                print(
                    f"  {name}, {w} worker(s): hit {OURS} {o:.1%} vs SWA-unaware {u:.1%} ({o / max(u, 1e-9):.2f}x), "
                    f"vs SGLang-style L1 {g:.1%} ({o / max(g, 1e-9):.2f}x); same-tier L1 {l1:.1%} vs SGLang-style "
                    f"{g:.1%} ({l1 / max(g, 1e-9):.3f}x)  -> {'MET' if ok else 'NOT MET'}"
                )
    if "chat" in names and 4 in workers and OURS in have:
        ratios = [runs[("chat", s, OURS, 4)].hit / info[("chat", s)]["oracle_hit"] for s in seeds]
        ok = float(np.median(ratios)) >= 0.9
        verdicts["chat_4_workers_vs_infinite"] = ok
        print(
            f"  chat, 4 workers sharing L3: token hit / infinite single cache (oracle) = "
            f"{median_range(ratios, lambda x: f'{x:.3f}')} (>= 0.90)  -> {'MET' if ok else 'NOT MET'}"
        )
    return verdicts
