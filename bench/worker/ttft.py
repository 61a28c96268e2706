"""TTFT: the TTFT scheduler vs a strong FCFS, over a load sweep and several seeds.

Both policies run the real Engine (real scheduler, SWA radix tree, dual pools, page
accounting, preemption) and share everything but the order (gcache/worker/engine/scheduler.py):
the step budgeting (the head of the order takes as much of the step as it can use, up to
--chunk-tokens, which defaults to the whole step: vLLM's and SGLang's chunked prefill), and
the in-flight prefix dedup (a request whose uncached prefix another request is computing
waits for it instead of computing it twice). FCFS is strict arrival order.

Compute clock (--cost):
  fitted (default): CostModel fitted to the real numpy model on this machine
           (bench/worker/ttft_cost.py; fitted once, ~30 s, then read from ~/.cache/gcache/);
  default: CostModel() defaults (an unfitted GPU-like shape; for quick checks).
--mode sim (default) advances a virtual clock by that cost per batch (SimulatedModel);
--mode real runs the real numpy model on every batch and advances the clock by the same
fitted cost (--clock fitted), or by measured wall time (--clock wall; noisy on a shared box);
its defaults keep a run near a minute: one seed, 100 requests, prompts and step x0.25.

Load: the capacity is what FCFS completes per virtual second with every request queued at
t = 0 (median over the seeds); each --loads L runs Poisson arrivals at L x capacity (or give
--rates directly). `busy` is the fraction of the time the engine computed. The floor row is
FCFS at 1/100 of the lowest rate: no queueing, the TTFT no ordering can beat.

Workload (seeded; the prompts do not depend on the rate): short requests (fresh prompts,
32..256 tokens) and long requests (>= 1024 tokens): document QA on a few hot documents (doc
+ a question; questions on one document come in bursts) and fresh long documents.
"long" = prompt of >= --long-tokens tokens.

Usage:  .venv/bin/python -m bench.worker.ttft [--loads 0.5,0.7,0.9] [--seeds 0,1,2,3,4] [--cost fitted|default]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

# the fitted clock; bench.hicache.hierarchy and bench.router.policies take it through ttft_cost.load_cost
from bench.common.stats import spread  # noqa: E402
from bench.worker.ttft_cost import FittedClockModel, default_cache_path, describe, load_or_calibrate  # noqa: E402
from gcache.worker.config import ModelConfig  # noqa: E402
from gcache.worker.engine.engine import Engine, EngineConfig  # noqa: E402
from gcache.worker.engine.request import SamplingParams  # noqa: E402
from gcache.worker.engine.scheduler import SchedulerConfig  # noqa: E402
from gcache.worker.kvcache.kv_pool import DualKVCache  # noqa: E402
from gcache.worker.model.sim import CostModel, SimulatedModel, VirtualClock  # noqa: E402

POLICIES = ("fcfs", "ttft")
METRICS = ("long_p50", "long_p90", "short_p50", "short_p90")


class Arrival(NamedTuple):
    t: float  # arrival, virtual seconds
    prompt: list  # token ids
    max_tokens: int
    kind: str  # short | doc_qa | fresh_long
    doc: int = -1  # doc_qa: which hot document the prompt starts with
    doc_len: int = 0


def make_workload(args, seed: int, rate: float | None) -> list[Arrival]:
    """Sorted by arrival; rate None: all at t = 0. The rng draws the same numbers whatever the
    rate, so every rate sees the same prompts."""
    rng = np.random.default_rng(seed)
    s = args.scale
    toks = lambda n: [int(t) for t in rng.integers(0, 256, size=max(1, int(n)))]
    docs = [toks(rng.integers(1024, 3072) * s) for _ in range(args.hot_docs)]
    out, t, burst = [], 0.0, []
    qa = lambda d: Arrival(
        t, docs[d] + toks(rng.integers(16, 64) * s), int(rng.integers(8, 32)), "doc_qa", d, len(docs[d])
    )
    while len(out) < args.requests:
        gap = rng.exponential(1.0)
        t += 0.0 if rate is None else gap / rate
        if burst:  # the rest of a document-QA burst arrives close together
            out.append(qa(burst.pop()))
            continue
        u = rng.random()
        if u < args.long_fraction * 0.6:
            d = int(rng.integers(len(docs)))
            burst = [d] * int(rng.integers(1, 4))
            out.append(qa(d))
        elif u < args.long_fraction:
            out.append(Arrival(t, toks(rng.integers(1024, 3072) * s), int(rng.integers(8, 32)), "fresh_long"))
        else:
            out.append(Arrival(t, toks(rng.integers(32, 256) * s), int(rng.integers(16, 64)), "short"))
    return out


def working_set(args, workload: list[Arrival]) -> str:
    """Requests by kind, prompt tokens, and distinct prompt tokens (a hot document once)."""
    kinds = {k: sum(1 for w in workload if w.kind == k) for k in ("short", "doc_qa", "fresh_long")}
    total = sum(len(w.prompt) for w in workload)
    docs = {w.doc: w.doc_len for w in workload if w.doc >= 0}
    distinct = total - sum(w.doc_len for w in workload) + sum(docs.values())
    pages = -(-distinct // ModelConfig().page_size)
    return (
        f"{len(workload)} requests: {kinds['short']} short, {kinds['doc_qa']} document QA on "
        f"{len(docs)} hot documents, {kinds['fresh_long']} fresh long; {total} prompt tokens, "
        f"{distinct} distinct (~{pages} pages; full pool {args.full_pages})"
    )


def build_engine(args, policy: str, clock: VirtualClock, max_waiting: int, mode: str) -> Engine:
    cfg = ModelConfig(dtype="float32")  # the default small hybrid model: 14 layers, W=128, ps=16
    if mode == "sim":
        model = SimulatedModel(cfg, clock, args.cost_model)
    else:
        from gcache.worker.model.transformer import Model

        model = Model(cfg)
        if args.clock == "fitted":
            model = FittedClockModel(model, args.cost_model, clock)
    kv = DualKVCache(cfg, args.full_pages, args.swa_pages)
    sc = scheduler_config(args, policy, max_waiting)
    return Engine(model, kv, EngineConfig(max_prompt_tokens=8192, max_new_tokens=256, scheduler=sc), clock=clock)


def scheduler_config(args, policy: str, max_waiting: int = 1024) -> SchedulerConfig:
    return SchedulerConfig(
        policy=policy,
        max_running=args.max_running,
        max_waiting=max_waiting,
        max_tokens_per_step=args.step_tokens,
        chunk_tokens=args.chunk_tokens,
        aging_tokens_per_s=args.aging,
        max_wait_s=args.max_wait_s,
        dedup_min_tokens=args.dedup_min_tokens,
    )


def run_policy(args, policy: str, workload, mode: str | None = None) -> dict:
    """One policy on one workload; TTFT = first token - scheduled arrival (virtual seconds)."""
    mode = mode or args.mode
    clock = VirtualClock()
    engine = build_engine(args, policy, clock, max_waiting=max(1024, len(workload)), mode=mode)
    reqs, i, busy = [], 0, 0.0
    steps_max = 50 * sum(len(w.prompt) + w.max_tokens for w in workload) + 1000  # far above any real run
    for _ in range(steps_max):
        while i < len(workload) and workload[i].t <= clock():
            w = workload[i]
            r = engine.add_request(w.prompt, SamplingParams(max_tokens=w.max_tokens, temperature=0.0))
            r.arrival_s = w.t  # arrived at its scheduled time, even if added a bit after
            reqs.append(r)
            i += 1
        if engine.has_work():
            t0, c0 = time.perf_counter(), clock()
            pending = [r for r in reqs if r.first_token_s is None]
            engine.step()
            if mode == "real" and args.clock == "wall":
                clock.advance(time.perf_counter() - t0)
                for r in pending:  # the engine stamped them before the clock moved: the step counts
                    if r.first_token_s is not None:
                        r.first_token_s = clock()
            busy += clock() - c0
            if not engine.last_step_ran:
                if i >= len(workload):
                    raise RuntimeError(f"{policy}: the engine has work but ran nothing and nothing else arrives")
                clock.advance_to(workload[i].t)
        elif i < len(workload):
            clock.advance_to(workload[i].t)
        else:
            break
    else:
        raise RuntimeError(f"{policy}: not done after {steps_max} steps")
    long_ = [r.ttft_s for r in reqs if len(r.prompt) >= args.long_tokens]
    short = [r.ttft_s for r in reqs if len(r.prompt) < args.long_tokens]
    m = engine.metrics.snapshot()
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
    out = {
        "policy": policy,
        "n_long": len(long_),
        "n_short": len(short),
        "long_p50": pct(long_, 50),
        "long_p90": pct(long_, 90),
        "short_p50": pct(short, 50),
        "short_p90": pct(short, 90),
        "hit": m["cached_prompt_tokens_total"] / max(1, m["prompt_tokens_total"]),
        "computed": m["prefill_tokens_computed_total"],
        "preempt": m["preemptions_total"],
        "makespan": clock(),
        "busy": busy / max(1e-12, clock() - workload[0].t),
    }
    if isinstance(engine.model, FittedClockModel):
        out["real_wall_s"], out["fitted_s"] = engine.model.wall_s, engine.model.fitted_s
    return out


def capacity(args, seeds: list[int]) -> float:
    """Requests per virtual second FCFS completes with all queued at t = 0 (median over seeds).
    Dedup holds are unbounded in this run (in the sweep they end at --max-wait-s), so the rates
    do not move with that knob; the sim runs the same fitted clock as --mode real."""
    caps, saved = [], args.max_wait_s
    args.max_wait_s = 1e9
    try:
        for seed in seeds:
            res = run_policy(args, "fcfs", make_workload(args, seed, None), mode="sim")
            caps.append(args.requests / res["makespan"])
    finally:
        args.max_wait_s = saved
    return float(np.median(caps))


def goal_met(change: dict) -> bool:
    """The production target: long P90 -30% or better vs FCFS, short requests no worse (P90)."""
    return change["long_p90"] <= -30 and change["short_p90"] <= 0


def fmt3(t: tuple[float, float, float], pct: bool = False) -> str:
    if pct:
        return f"{t[0]:+.0f}/{t[1]:+.0f}/{t[2]:+.0f}%"
    return f"{t[0]:.2f}/{t[1]:.2f}/{t[2]:.2f}s"


def table_row(label: str, rate: str, runs: list[dict]) -> str:
    cells = " ".join(f"{fmt3(spread([r[m] for r in runs])):>19}" for m in METRICS)
    med = lambda k: float(np.median([r[k] for r in runs]))
    return (
        f"{label:>5} {rate:>7} {runs[0]['policy']:6} {med('busy'):5.2f} {cells} {med('hit'):6.1%} {med('preempt'):7.0f}"
    )


def report(sweep: list[dict], floor: list[dict], seeds: list[int]) -> None:
    print(
        f"\nmin/median/max over seeds {seeds}; TTFT in virtual seconds; busy = fraction of the time the "
        "engine computed; floor = FCFS at 1/100 of the lowest rate (no queueing: what no order can beat)"
    )
    print(
        f"{'load':>5} {'rate/s':>7} {'policy':6} {'busy':>5} "
        + " ".join(f"{m:>19}" for m in METRICS)
        + f" {'hit':>6} {'preempt':>7}"
    )
    print(table_row("floor", "", floor))
    for point in sweep:
        load = "" if point["load"] is None else f"{point['load']:.2f}"
        for p in POLICIES:
            print(table_row(load, f"{point['rate']:.2f}", point["runs"][p]))
        cells = " ".join(f"{fmt3(spread(point['change'][m]), pct=True):>19}" for m in METRICS)
        print(f"{'':5} {'':7} {'ttft vs fcfs':18} {cells}")
    print("\ngoal (long P90 -30% or better vs FCFS, short P90 no worse), on the median change per rate:")
    floor_l90 = float(np.median([r["long_p90"] for r in floor]))
    for point in sweep:
        ch, runs = point["change"], point["runs"]
        med = {m: float(np.median(ch[m])) for m in METRICS}
        alone = sum(goal_met({m: ch[m][k] for m in METRICS}) for k in range(len(seeds)))
        f90 = float(np.median([r["long_p90"] for r in runs["fcfs"]]))
        t90 = float(np.median([r["long_p90"] for r in runs["ttft"]]))
        queueing = (f90 - t90) / (f90 - floor_l90) if f90 > floor_l90 else float("nan")
        print(
            f"  {point['rate']:.2f}/s: long P90 {med['long_p90']:+.1f}%, short P90 {med['short_p90']:+.1f}%, "
            f"short P50 {med['short_p50']:+.1f}% -> {'MET' if goal_met(med) else 'NOT MET'} "
            f"({alone}/{len(seeds)} seeds alone); FCFS long P90 is {f90 / floor_l90:.1f}x the floor, "
            f"ttft removes {queueing:.0%} of that queueing"
        )


def run_sweep(args, seeds: list[int], t_start: float) -> tuple[list[dict], list[dict]]:
    if args.rates:
        points = [(None, float(r)) for r in args.rates.split(",") if r]
    else:
        cap = capacity(args, seeds)
        print(f"capacity: {cap:.2f} requests/s (FCFS, every request queued at t = 0, median over seeds)")
        points = [(float(x), float(x) * cap) for x in args.loads.split(",") if x]
    print("rates: --rates " + ",".join(f"{r:.3g}" for _, r in points))
    floor_rate = min(r for _, r in points) / 100
    floor = [run_policy(args, "fcfs", make_workload(args, seed, floor_rate)) for seed in seeds]
    sweep = []
    for load, rate in points:
        runs = {p: [] for p in POLICIES}
        for seed in seeds:
            wl = make_workload(args, seed, rate)
            for p in POLICIES:
                runs[p].append(run_policy(args, p, wl))
        change = {m: [(t[m] - f[m]) / f[m] * 100 for f, t in zip(runs["fcfs"], runs["ttft"])] for m in METRICS}
        sweep.append({"load": load, "rate": rate, "runs": runs, "change": change})
        print(f"  rate {rate:.2f}/s done ({time.perf_counter() - t_start:.0f} s)")
    return sweep, floor


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("sim", "real"), default="sim")
    ap.add_argument("--cost", choices=("fitted", "default"), default="fitted", help="see above")
    ap.add_argument("--clock", choices=("fitted", "wall"), default="fitted", help="--mode real: see above")
    ap.add_argument("--requests", type=int, default=None, help="per seed (default 600; --mode real: 100)")
    ap.add_argument(
        "--loads",
        default=None,
        help="arrival rates as fractions of the capacity (default 0.5,0.7,0.9; --mode real: 0.7)",
    )
    ap.add_argument("--rates", default="", help="arrivals per virtual second (overrides --loads)")
    ap.add_argument("--seeds", default=None, help="default 0,1,2,3,4; --mode real: 0")
    ap.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply every prompt length (default 1; "
        "--mode real: 0.25, so the numpy model's runs take minutes, not hours)",
    )
    ap.add_argument("--long-fraction", type=float, default=0.3)
    ap.add_argument("--long-tokens", type=int, default=0, help="long = prompt >= this (default 1024*scale)")
    ap.add_argument("--hot-docs", type=int, default=8)
    ap.add_argument("--full-pages", type=int, default=4096)
    ap.add_argument("--swa-pages", type=int, default=2048)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="default 512; --mode real: 128 (prompts are scaled by 0.25 there: prefills still span steps)",
    )
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="most prefill tokens per request per step (both policies; default: the whole step)",
    )
    ap.add_argument(
        "--aging",
        type=float,
        default=SchedulerConfig.aging_tokens_per_s,
        help="ttft: uncached tokens of priority per second waited",
    )
    ap.add_argument("--max-wait-s", type=float, default=SchedulerConfig.max_wait_s)
    ap.add_argument("--dedup-min-tokens", type=int, default=32, help="ablation: 10**9 turns in-flight dedup off (both)")
    ap.add_argument("--cal-repeats", type=int, default=5)
    ap.add_argument(
        "--cal-file",
        default="",
        help="JSON: load the fitted costs from it, or fit and save them "
        "there (default: a per-machine file under ~/.cache/gcache/)",
    )
    ap.add_argument("--recalibrate", action="store_true", help="refit the cost model even if a fit is saved")
    ap.add_argument("--json", default="", help="also write every figure to this JSON file")
    ap.add_argument("--plot", default="", help="also draw TTFT percentiles vs load per policy (PNG)")
    args = ap.parse_args(argv)
    real = args.mode == "real"
    for name, sim_default, real_default in (
        ("requests", 600, 100),
        ("loads", "0.5,0.7,0.9", "0.7"),
        ("seeds", "0,1,2,3,4", "0"),
        ("scale", 1.0, 0.25),
        ("step_tokens", 512, 128),
    ):
        if getattr(args, name) is None:
            setattr(args, name, real_default if real else sim_default)
    args.long_tokens = args.long_tokens or int(1024 * args.scale)
    args.chunk_tokens = args.chunk_tokens or args.step_tokens
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    return args


def plot_sweep(sweep: list[dict], path: str) -> None:
    """One panel per TTFT percentile: the median over seeds vs load, a curve per policy."""
    import statistics

    from gcache.tools.plotting import charts

    plt = charts.pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6), squeeze=False)
    xs = [pt["load"] if pt["load"] is not None else pt["rate"] for pt in sweep]
    xlabel = "load (x capacity)" if sweep and sweep[0]["load"] is not None else "arrivals / s"
    for ax, metric in zip(axes[0], METRICS):
        series = {
            policy: (xs, [statistics.median(r[metric] for r in pt["runs"][policy]) for pt in sweep])
            for policy in POLICIES
        }
        charts.line_panel(ax, f"TTFT {metric.replace('_', ' ')}", xlabel, "seconds", series)
    charts.save(fig, path)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    print("command: .venv/bin/python -m bench.worker.ttft " + " ".join(argv))
    if args.cost == "fitted" or args.mode == "real":
        args.cal_file = args.cal_file or default_cache_path(ModelConfig(dtype="float32"), args.cal_repeats)
        args.cost_model, err = load_or_calibrate(args, log=print)
        print(f"compute clock: fitted to the real numpy model: {describe(args.cost_model, err)}")
    else:
        args.cost_model = CostModel()
        print("compute clock: CostModel() defaults (not fitted)")
    cfg = ModelConfig(dtype="float32")
    sc = scheduler_config(args, "ttft")
    print(
        f"model: {cfg.layers} layers ({len(cfg.full_layers)} full), W={cfg.window}, page {cfg.page_size}; "
        f"pools {args.full_pages} full / {args.swa_pages} SWA pages; mode {args.mode}; "
        f"{args.requests} requests per seed, prompt lengths x{args.scale:g}"
    )
    print(
        f"shared budgeting: {sc.max_tokens_per_step} tokens/step, <= {sc.chunk_tokens} per request, "
        f"{sc.max_running} running; dedup of in-flight prefixes >= {sc.dedup_min_tokens} tokens (both policies); "
        f"ttft aging {sc.aging_tokens_per_s:g} tokens/s, max wait {sc.max_wait_s:g}s"
    )
    seeds = [int(x) for x in args.seeds.split(",") if x]
    for seed in seeds:
        print(
            f"working set, seed {seed}: {working_set(args, make_workload(args, seed, None))}; "
            f"long = prompt >= {args.long_tokens} tokens"
        )
    sweep, floor = run_sweep(args, seeds, t_start)
    report(sweep, floor, seeds)
    result = {"command": argv, "seeds": seeds, "sweep": sweep, "floor": floor, "cost": args.cost_model.__dict__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
    if args.plot:
        plot_sweep(sweep, args.plot)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return result


if __name__ == "__main__":
    main()
