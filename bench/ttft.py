"""TTFT: the TTFT scheduler vs FCFS on a mixed long/short workload.

Both policies run the real Engine (real scheduler, SWA radix tree, dual pools, page
accounting, preemption). Compute is either
  --mode sim  (default): SimulatedModel, a cost model that advances a virtual clock
              (gcache/worker/sim_model.py documents the formula); deterministic, fast;
  --mode real: the real numpy model; each step advances the virtual clock by its measured
              wall time (so the shared machine's noise shows up in the figures).
Arrivals are a seeded Poisson process in virtual time; TTFT = first token - arrival.

Workload (seeded): short requests (fresh prompts, 32..256 tokens) and long requests
(>= 1024 tokens): document QA on a few hot documents (doc + a question; questions on one
document come in bursts, as when a user asks several things about one file) and fresh long
documents. "long" = prompt of >= --long-tokens tokens.

Usage:  .venv/bin/python bench/ttft.py [--mode sim|real] [--requests N] [--rate R] [--seed S]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gcache.worker.config import ModelConfig  # noqa: E402
from gcache.worker.engine import Engine, EngineConfig  # noqa: E402
from gcache.worker.kv_pool import DualKVCache  # noqa: E402
from gcache.worker.request import SamplingParams  # noqa: E402
from gcache.worker.scheduler import SchedulerConfig  # noqa: E402
from gcache.worker.sim_model import SimulatedModel, VirtualClock  # noqa: E402


def make_workload(args) -> list[tuple[float, list[int], int]]:
    """[(arrival_s, prompt, max_tokens)] sorted by arrival."""
    rng = np.random.default_rng(args.seed)
    s = args.scale
    toks = lambda n: [int(t) for t in rng.integers(0, 256, size=max(1, int(n)))]
    docs = [toks(rng.integers(1024, 3072) * s) for _ in range(args.hot_docs)]
    out, t, burst = [], 0.0, []
    while len(out) < args.requests:
        t += rng.exponential(1.0 / args.rate)
        if burst:  # the rest of a document-QA burst arrives close together
            out.append((t, burst.pop() + toks(rng.integers(16, 64) * s), int(rng.integers(8, 32))))
            continue
        u = rng.random()
        if u < args.long_fraction * 0.6:
            doc = docs[int(rng.integers(len(docs)))]
            burst = [doc] * int(rng.integers(1, 4))
            out.append((t, doc + toks(rng.integers(16, 64) * s), int(rng.integers(8, 32))))
        elif u < args.long_fraction:
            out.append((t, toks(rng.integers(1024, 3072) * s), int(rng.integers(8, 32))))
        else:
            out.append((t, toks(rng.integers(32, 256) * s), int(rng.integers(16, 64))))
    return out


def build_engine(args, policy: str, clock: VirtualClock) -> Engine:
    cfg = ModelConfig(dtype="float32")  # the default small hybrid model: 14 layers, W=128, ps=16
    model = SimulatedModel(cfg, clock) if args.mode == "sim" else None
    if model is None:
        from gcache.worker.model import Model
        model = Model(cfg)
    kv = DualKVCache(cfg, args.full_pages, args.swa_pages)
    sc = SchedulerConfig(policy=policy, max_running=32, max_tokens_per_step=args.step_tokens,
                         chunk_tokens=args.chunk_tokens, long_threshold_tokens=args.long_tokens,
                         aging_tokens_per_s=args.aging, max_wait_s=args.max_wait_s,
                         dedup_min_tokens=args.dedup_min_tokens)
    return Engine(model, kv, EngineConfig(max_prompt_tokens=8192, max_new_tokens=256, scheduler=sc), clock=clock)


def run_policy(args, policy: str, workload) -> dict:
    clock = VirtualClock()
    engine = build_engine(args, policy, clock)
    reqs, i = [], 0
    for _ in range(10_000_000):
        while i < len(workload) and workload[i][0] <= clock():
            arrival, prompt, max_tokens = workload[i]
            r = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            r.arrival_s = arrival  # arrived at its scheduled time, even if added a bit after
            reqs.append(r)
            i += 1
        if engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            if args.mode == "real":
                clock.advance(time.perf_counter() - t0)
        elif i < len(workload):
            clock.advance_to(workload[i][0])
        else:
            break
    long_ = [r.ttft_s for r in reqs if len(r.prompt) >= args.long_tokens]
    short = [r.ttft_s for r in reqs if len(r.prompt) < args.long_tokens]
    m = engine.metrics.snapshot()
    return {"policy": policy, "n_long": len(long_), "n_short": len(short),
            "long_p50": np.percentile(long_, 50), "long_p90": np.percentile(long_, 90),
            "short_p50": np.percentile(short, 50), "short_p90": np.percentile(short, 90),
            "hit": m["cached_prompt_tokens_total"] / max(1, m["prompt_tokens_total"]),
            "preempt": m["preemptions_total"], "makespan": clock()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("sim", "real"), default="sim")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=20.0, help="arrivals per virtual second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length")
    ap.add_argument("--long-fraction", type=float, default=0.3)
    ap.add_argument("--long-tokens", type=int, default=0, help="long = prompt >= this (default 1024*scale)")
    ap.add_argument("--hot-docs", type=int, default=8)
    ap.add_argument("--full-pages", type=int, default=4096)
    ap.add_argument("--swa-pages", type=int, default=2048)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--aging", type=float, default=500.0, help="uncached tokens per second waited")
    ap.add_argument("--max-wait-s", type=float, default=20.0)
    ap.add_argument("--dedup-min-tokens", type=int, default=32, help="ablation: 10**9 turns in-flight dedup off")
    args = ap.parse_args(argv)
    if args.mode == "real" and args.scale == 1.0 and args.requests == 600:
        args.scale, args.requests, args.rate = 0.125, 160, 4.0  # keep CPU runs to minutes
    args.long_tokens = args.long_tokens or int(1024 * args.scale)
    workload = make_workload(args)
    print("command: .venv/bin/python bench/ttft.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"mode={args.mode} requests={len(workload)} rate={args.rate}/s seed={args.seed} scale={args.scale}")
    rows = [run_policy(args, p, workload) for p in ("fcfs", "ttft")]
    head = f"{'policy':7} {'long':>5} {'short':>5} {'long P50':>9} {'long P90':>9} {'short P50':>10} " \
           f"{'short P90':>10} {'hit':>6} {'preempt':>7} {'makespan':>9}"
    print(head)
    for r in rows:
        print(f"{r['policy']:7} {r['n_long']:5d} {r['n_short']:5d} {r['long_p50']:8.3f}s {r['long_p90']:8.3f}s "
              f"{r['short_p50']:9.3f}s {r['short_p90']:9.3f}s {r['hit']:6.1%} {r['preempt']:7d} {r['makespan']:8.1f}s")
    f, t = rows
    ch = lambda k: (t[k] - f[k]) / f[k] * 100
    print(f"ttft vs fcfs: long P90 {ch('long_p90'):+.1f}%, long P50 {ch('long_p50'):+.1f}%, "
          f"short P50 {ch('short_p50'):+.1f}%, short P90 {ch('short_p90'):+.1f}%")
    ok = ch("long_p90") <= -30 and t["short_p50"] <= f["short_p50"] and t["short_p90"] <= f["short_p90"]
    print("goal (long P90 -30% or better, short no worse):", "MET" if ok else "NOT MET")
    return 0


if __name__ == "__main__":
    sys.exit(main())
