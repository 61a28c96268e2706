"""What crediting GCache's shared L3 in the router's score changes, on slices of the multi-turn
conversation trace: the tier-aware score (cache_aware with L3 credited, tier weights
1,0.8,0.5) against the report's formula (the seed's score: matchWeight x prefix match -
normalised load, no L3 credit: tier weights 1,0.8,0), with round robin and least load beside
them. The policies are the real gcache.router.policies objects; engines, the L3 and time are
bench/router/tier_sim.py's model (deterministic, seconds per run).

Scenarios: `all` (every engine runs the GCache connector) and `half` (half of them do: a mixed
fleet, where only those can load what the L3 holds). L1 per engine = --l1-frac x working set /
engines (aggregate L1 = l1-frac x working set), the L3 = --l3-frac x working set. Prefill cost
per token: L1 0, L3 --l3-ratio (0.1), recompute 1. Load = Poisson arrival rate / what the
engines prefill per second if nothing hit (1.0 = saturated without a cache).

Reported per (scenario, load), over the trace slices (min / median / max): prefill cost and
TTFT P90 of each policy relative to the report's formula in the same slice (< 1: better),
and the hit rates by tier.

  .venv/bin/python -m bench.router.tiers                    # 5 slices x 2000 records, all + half, loads 0.5,0.9
  .venv/bin/python -m bench.router.tiers --l1-frac 0.1      # small engine memory: the L3 matters more
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common.paths import CONVERSATION_TRACE
from bench.common.stats import median_range, spread
from bench.router.tier_sim import (
    POLICY_KNOBS,
    TierCosts,
    TierSpec,
    connectors_for,
    policy_knobs,
    sim_turns,
    simulate,
    working_set_pages,
)
from bench.router.workloads import poisson_arrivals, trace_slice

REFERENCE = "report"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    ap.add_argument("--slices", type=int, default=5, help="trace slices (each its own figures)")
    ap.add_argument("--requests", type=int, default=2000, help="trace records per slice")
    ap.add_argument("--stride", type=int, default=2400, help="slice s reads records from s x stride")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--scenarios", default="all,half", help="all: connector on every engine; half: on half")
    ap.add_argument("--l1-frac", type=float, default=0.5, help="aggregate engine memory / working set")
    ap.add_argument("--l3-frac", type=float, default=2.0, help="the shared L3 / working set")
    ap.add_argument("--loads", default="0.5,0.9", help="arrival rate / the engines' no-hit prefill rate")
    ap.add_argument("--l3-ratio", type=float, default=0.1, help="cost of an L3 token / a recomputed one")
    ap.add_argument("--l3-weight", type=float, default=0.5, help="tier_aware's L3 tier weight")
    ap.add_argument("--policies", default=",".join(POLICY_KNOBS))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--block-tokens", type=int, default=128, help="tokens per 512-token trace block")
    ap.add_argument("--prompt-max", type=int, default=8192, help="prompt tokens cap (scaled)")
    ap.add_argument("--output-max", type=int, default=512, help="output tokens cap (scaled)")
    ap.add_argument("--prefill-tok-s", type=float, default=10000.0, help="recomputed prompt tokens per second")
    ap.add_argument("--decode-tok-s", type=float, default=50.0, help="output tokens per second per request")
    ap.add_argument("--seed", type=int, default=0, help="arrival seed (slice s uses seed + s)")
    return ap.parse_args(argv)


def run(args) -> dict:
    knobs = policy_knobs(args.l3_weight)
    policies = [p for p in args.policies.split(",") if p]
    if REFERENCE not in policies:
        policies.append(REFERENCE)
    scenarios = [s for s in args.scenarios.split(",") if s]
    loads = [float(x) for x in args.loads.split(",") if x]
    costs = TierCosts(0.0, args.l3_ratio, 1.0)
    out: dict = {"slices": [], "runs": {}}
    for s in range(args.slices):
        raw = trace_slice(
            args.trace, s * args.stride, args.requests, args.block_tokens, args.prompt_max, args.output_max
        )
        turns = sim_turns(raw, args.page_size)
        ws = working_set_pages(turns)
        longest = max(len(t.ids) for t in turns)
        l1 = max(int(args.l1_frac * ws / args.engines), longest + 1)  # a prompt always fits
        mean_tokens = sum(t.tokens for t in turns) / len(turns)
        out["slices"].append(
            dict(
                offset=s * args.stride,
                requests=len(turns),
                conversations=sum(t.after < 0 for t in turns),
                ws_pages=ws,
                l1_pages=l1,
                l1_raised=l1 > int(args.l1_frac * ws / args.engines),
                mean_tokens=mean_tokens,
            )
        )
        for scen in scenarios:
            spec = TierSpec(
                args.engines,
                connectors_for(scen, args.engines),
                l1,
                max(1, int(args.l3_frac * ws)),
                args.page_size,
                costs,
                1.0 / args.prefill_tok_s,
                1.0 / args.decode_tok_s,
            )
            for load in loads:
                rate = load * args.engines / (mean_tokens / args.prefill_tok_s)
                arrivals = poisson_arrivals(len(turns), rate, args.seed + s)
                for p in policies:
                    out["runs"][(s, scen, load, p)] = simulate(turns, spec, p, knobs[p], arrivals)
    return out


def rel(out, s, scen, load, p, metric) -> float:
    a, b = out["runs"][(s, scen, load, p)], out["runs"][(s, scen, load, REFERENCE)]
    return metric(a) / metric(b) if metric(b) else float("nan")


def report(args, out) -> None:
    slices = range(args.slices)
    scenarios = [s for s in args.scenarios.split(",") if s]
    loads = [float(x) for x in args.loads.split(",") if x]
    policies = list(dict.fromkeys(p for (_, _, _, p) in out["runs"]))
    ws = [x["ws_pages"] for x in out["slices"]]
    print(
        f"trace {args.trace.name}: {args.slices} slices x {args.requests} records (stride {args.stride}); "
        f"working set {median_range(ws, '{:.0f}'.format)} pages of {args.page_size} tokens; "
        f"conversations per slice {median_range([x['conversations'] for x in out['slices']], '{:.0f}'.format)}"
    )
    raised = sum(x["l1_raised"] for x in out["slices"])
    print(
        f"{args.engines} engines, L1 {args.l1_frac} x working set in all (per engine "
        f"{median_range([x['l1_pages'] for x in out['slices']], '{:.0f}'.format)} pages"
        + (f"; raised to the longest prompt in {raised} slices" if raised else "")
        + f"), L3 {args.l3_frac} x working set; cost per token L1 0 / L3 {args.l3_ratio} / recompute 1; "
        f"report = cache_aware tier weights 1,0.8,0; tier_aware = 1,0.8,{args.l3_weight}"
    )
    for scen in scenarios:
        for load in loads:
            print(f"\n[{scen}: connector on {'every engine' if scen == 'all' else 'half the engines'}; load {load}]")
            print(
                f"{'policy':<12} {'hit L1':>7} {'hit L3':>7} {'cost / report (med [min..max])':>32} "
                f"{'TTFT P90 / report':>28} {'P50 ms':>8} {'P90 ms':>8}"
            )
            for p in policies:
                runs = [out["runs"][(s, scen, load, p)] for s in slices]
                l1 = [r.l1_tokens / max(1, r.prompt_tokens) for r in runs]
                l3 = [r.l3_tokens / max(1, r.prompt_tokens) for r in runs]
                cost = [rel(out, s, scen, load, p, lambda r: r.prefill_cost) for s in slices]
                p90 = [rel(out, s, scen, load, p, lambda r: r.ttft(90)) for s in slices]
                print(
                    f"{p:<12} {spread(l1)[1]:>7.1%} {spread(l3)[1]:>7.1%} {median_range(cost, '{:.3f}'.format):>32} {median_range(p90, '{:.3f}'.format):>28} "
                    f"{spread([r.ttft(50) for r in runs])[1] * 1e3:>8.1f} "
                    f"{spread([r.ttft(90) for r in runs])[1] * 1e3:>8.1f}"
                )


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.perf_counter()
    print("command: .venv/bin/python -m bench.router.tiers " + " ".join(argv))
    out = run(args)
    report(args, out)
    print(f"\nwall time {time.perf_counter() - t0:.0f}s")
    return out


if __name__ == "__main__":
    main()
