"""PD disaggregation on the fitted compute clock: TTFT and TPOT, 2 prefill + 2 decode vs 4 mixed.

    python -m bench.pd.disagg                   # 3 loads x 3 seeds, ~1-3 min
    python -m bench.pd.disagg --quick           # a check that everything runs, not the figures

Per seed and load: one workload (long prompts 8k-30k tokens among decode-heavy requests,
Poisson arrivals) run three ways on the same engines and clock (bench/pd/sim.py): 4 mixed
workers; 2P+2D with host pre-allocation of handoffs (gcache's); 2P+2D with device
pre-allocation (device pages taken when a handoff's read starts). Ratios are taken within one
seed's run, then min / median / max over seeds. Load x1 is the arrival rate at which the
requests' summed single-worker service time equals 50% of 4 workers' time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common.stats import median_range
from bench.pd.sim import Setup, handoff_bytes, run, workload
from bench.worker.ttft_cost import add_cost_args, default_cache_path, load_cost
from gcache.worker.config import ModelConfig

MODES = ("mixed", "pd_host", "pd_device")


def service_s(cfg: ModelConfig, cost, job, chunk: int) -> float:
    """One request alone on one worker: its prefill chunks, then its decode steps."""
    f = len(cfg.full_layers) / cfg.layers
    t, ctx = 0.0, 0
    n = len(job.prompt)
    while ctx < n:
        k = min(chunk, n - ctx)
        ctx += k
        t += cost.cost_s(cost.features([(k, ctx)], f, cfg.window))
    for i in range(job.max_tokens - 1):
        t += cost.cost_s(cost.features([(1, n + i + 1)], f, cfg.window))
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pd.disagg", description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="1,1.5,2", help="arrival-rate multipliers")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--long-share", type=float, default=0.25, help="fraction of long-prompt requests")
    ap.add_argument("--link-gbs", type=float, default=10.0, help="each worker's link to L3, GB/s")
    ap.add_argument("--full-pages", type=int, default=6144, help="device full pages per worker")
    ap.add_argument("--swa-pages", type=int, default=1024)
    ap.add_argument("--l2-mib", type=int, default=256, help="host pool per worker")
    ap.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=2048,
        help="PD: prompts shorter than this skip the prefill pool (gcache-router's bypass; 0 = none)",
    )
    ap.add_argument("--prefill", type=int, default=2, help="prefill workers of the 4 in PD (2 = 2P+2D)")
    ap.add_argument("--quick", action="store_true", help="1 load, 1 seed, 12 requests, short 'long' prompts")
    add_cost_args(ap)
    args = ap.parse_args(argv)
    cfg = ModelConfig(dtype="float32")
    if not args.cal_file and args.cost == "fitted":
        args.cal_file = default_cache_path(cfg, args.cal_repeats)
    cost, cost_line = load_cost(args)
    loads = [float(x) for x in args.loads.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    n, long_range = args.requests, (8192, 30720)
    if args.quick:
        loads, seeds, n, long_range = loads[-1:], seeds[:1], 12, (2048, 4096)
    setup = Setup(
        args.full_pages,
        args.swa_pages,
        args.l2_mib << 20,
        args.link_gbs,
        pd_min_prompt_tokens=args.pd_min_prompt_tokens,
    )
    if not 1 <= args.prefill <= 3:
        ap.error("--prefill must be 1, 2 or 3 (of 4 workers)")
    print(f"compute clock: {cost_line}")
    print(f"PD: {args.prefill} prefill + {4 - args.prefill} decode workers; mixed: 4 workers")
    print(
        f"setup: {n} requests per run, {args.long_share:.0%} long ({long_range[0]}-{long_range[1]} tokens in, 32-128 out), "
        f"the rest 256-1024 in / 256-512 out; per worker {setup.full_pages} full + {setup.swa_pages} SWA device pages, "
        f"L2 {args.l2_mib} MiB, link {args.link_gbs:g} GB/s; chunk {setup.chunk_tokens}, step budget "
        f"{setup.max_tokens_per_step} tokens; PD bypass below {setup.pd_min_prompt_tokens} prompt tokens"
    )
    _, _, b = handoff_bytes(cfg, 1 << 14)
    print(f"handoff: {b / (1 << 14):.0f} bytes per prompt token (16k-token prompt: {b / 2**20:.1f} MiB)")
    rows = {}
    t0 = time.perf_counter()
    for load in loads:
        for seed in seeds:
            probe = workload(n, 1.0, seed, args.long_share, long_range)
            mean_s = float(np.mean([service_s(cfg, cost, j, setup.chunk_tokens) for j in probe]))
            rate = load * 0.5 * 4 / mean_s
            jobs = workload(n, rate, seed, args.long_share, long_range)
            rows[(load, seed)] = {m: run(cfg, jobs, setup, cost, m, n_prefill=args.prefill) for m in MODES}
            print(
                f"  load x{load:g} seed {seed}: rate {rate:.3f}/s done ({time.perf_counter() - t0:.0f} s)", flush=True
            )
    ms = lambda v: f"{v * 1e3:.0f}"  # noqa: E731
    rt = lambda v: f"{v:.2f}x"  # noqa: E731
    print("\nTTFT and TPOT (ms, median [min..max] over seeds); ratios mixed / PD (host), within each run")
    print(f"{'load':>5} {'mode':>9} {'TTFT P50':>22} {'TTFT P90':>22} {'TPOT P50':>18} {'TPOT P90':>18} {'preempt':>8}")
    for load in loads:
        for m in MODES:
            rs = [rows[(load, s)][m] for s in seeds]
            print(
                f"x{load:<4g} {m:>9} {median_range([r.q(r.ttft_s, 50) for r in rs], ms):>22} "
                f"{median_range([r.q(r.ttft_s, 90) for r in rs], ms):>22} "
                f"{median_range([r.q(r.tpot_s, 50) for r in rs], ms):>18} "
                f"{median_range([r.q(r.tpot_s, 90) for r in rs], ms):>18} "
                f"{median_range([r.preemptions for r in rs], lambda v: f'{v:.0f}'):>8}"
            )
        mix = [rows[(load, s)]["mixed"] for s in seeds]
        pdh = [rows[(load, s)]["pd_host"] for s in seeds]
        tpot90 = [a.q(a.tpot_s, 90) / b.q(b.tpot_s, 90) for a, b in zip(mix, pdh)]
        ttft90 = [b.q(b.ttft_s, 90) / a.q(a.ttft_s, 90) for a, b in zip(mix, pdh)]
        tpot50 = [a.q(a.tpot_s, 50) / b.q(b.tpot_s, 50) for a, b in zip(mix, pdh)]
        print(
            f"x{load:<4g} ratios: TPOT P90 mixed/PD {median_range(tpot90, rt)}, TPOT P50 {median_range(tpot50, rt)}, "
            f"TTFT P90 PD/mixed {median_range(ttft90, rt)}"
        )
    print("\nHandoffs (PD, host pre-allocation): bytes and link time per handed token")
    for load in loads:
        rs = [rows[(load, s)]["pd_host"] for s in seeds]
        per_tok = [r.handoff_bytes / max(1, r.handoff_tokens) for r in rs]
        us_tok = [r.transfer_s / max(1, r.handoff_tokens) * 1e6 for r in rs]
        print(
            f"x{load:<4g} {median_range([r.handoff_bytes / 2**20 for r in rs], lambda v: f'{v:.0f} MiB')} handed, "
            f"{median_range(per_tok, lambda v: f'{v:.0f} B')}/token, "
            f"{median_range(us_tok, lambda v: f'{v:.2f} us')}/token on the links (write + read)"
        )
    print("\nDevice KV held by handoffs in flight (pages, all decode workers): host vs device pre-allocation")
    for load in loads:
        dv = [rows[(load, s)]["pd_device"] for s in seeds]
        hs = [rows[(load, s)]["pd_host"] for s in seeds]
        run_d = [float(np.mean(r.running_samples)) if r.running_samples else 0.0 for r in dv]
        run_h = [float(np.mean(r.running_samples)) if r.running_samples else 0.0 for r in hs]
        print(
            f"x{load:<4g} device: peak {median_range([r.held_peak for r in dv], lambda v: f'{v:.0f}')} "
            f"mean {median_range([r.held_mean for r in dv], lambda v: f'{v:.0f}')} of {(4 - args.prefill) * setup.full_pages} "
            f"(TPOT P90 {median_range([r.q(r.tpot_s, 90) for r in dv], ms)} ms, running/step "
            f"{median_range(run_d, lambda v: f'{v:.1f}')}); host: 0 device pages (peak host slots "
            f"{median_range([r.host_peak for r in hs], lambda v: f'{v:.0f}')}; TPOT P90 "
            f"{median_range([r.q(r.tpot_s, 90) for r in hs], ms)} ms, running/step {median_range(run_h, lambda v: f'{v:.1f}')})"
        )
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
