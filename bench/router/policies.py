"""Routing policies across N workers: token hit rate per tier, TTFT P50/P90, throughput and
load imbalance, ours (cache_aware: the seed's score; cache_ttft: an estimated-TTFT cost)
against round_robin, least_load, an sgl-router-style approximate tree and a Dynamo-style
cost (both SWA-unaware), in one run.

What is real: per worker, the Engine (scheduler, SWA radix tree, dual device pools,
HiCache with an L2 host pool; with --l3 also L3Store on one shared real gcache-server);
the router (gcache.router.RouterCore, one per policy) and the workers' publisher
(gcache.worker.http.publisher.WorkerPublisher); the redis-server between them. Simulated: the
model's arithmetic (a cost model fitted to the real numpy model on this machine advances
each worker's virtual clock) and time itself: publishers flush and routers refresh every
--tick-s of virtual time, synchronously, so a run is deterministic (bench/router/sim.py).

Workloads: the generated multi-turn chat (bench/common/workloads.py) and slices of
../shared/data/traces/conversation_trace.jsonl (seed s = records from s * --trace-stride).
Arrivals: seeded Poisson at --rate-* requests/s per worker times each --load-scales point
(default 1 and 2: the headline rate and twice it, where workers hold several requests and
the imbalance ratio means something); a conversation's next turn
goes only after its previous turn finished. Budgets per worker: L1 = --l1-frac x working
set / workers (aggregate L1 = l1-frac x working set), L2 = --l2-per-l1 x L1.

Also: the SWA mis-routing case (bench/router/swa_case.py) and --real (bench/router/real.py):
real gcache-worker and gcache-router processes over HTTP.

  .venv/bin/python -m bench.router.policies           # load x1 (3 seeds, 4 + 8 workers) and x2 (2 seeds, 4 workers):
                                                      #   96 runs in 2 processes, ~6.5 min on this 2-core box
  .venv/bin/python -m bench.router.policies --quick   # ~10 s: a check that everything runs, not the figures
  .venv/bin/python -m bench.router.policies --real    # ~40 s: real gcache-worker / gcache-router processes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from bench.common.paths import CONVERSATION_TRACE  # noqa: E402
from bench.hicache.cluster import Budgets  # noqa: E402
from bench.hicache.workloads import model_for, oracle_hit_tokens  # noqa: E402
from bench.router.jobs import Job, run_all  # noqa: E402
from bench.router.report import print_targets, print_workload  # noqa: E402
from bench.router.workloads import chat_turns, trace_slice  # noqa: E402
from bench.worker.ttft_cost import add_cost_args, load_cost  # noqa: E402
from gcache.common.attention import AttentionKind  # noqa: E402
from gcache.worker.config import ModelConfig  # noqa: E402
from gcache.worker.engine.scheduler import SchedulerConfig  # noqa: E402
from gcache.worker.kvcache.kv_pool import DualKVCache  # noqa: E402

TRACE = CONVERSATION_TRACE
POLICIES = ("round_robin", "least_load", "approx_tree", "dynamo", "cache_aware", "cache_ttft")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny workloads, one seed, 2 workers: ~10 s")
    ap.add_argument("--workloads", default="chat,trace")
    ap.add_argument("--workers", default="4,8")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seeds", default="0,1,2", help="seeds at load scale 1 (the headline point)")
    ap.add_argument(
        "--load-scales",
        default=None,
        help="load sweep: each point multiplies --rate-chat / --rate-trace by this "
        "(default 1,2; --quick: 1); the first is the headline point",
    )
    ap.add_argument("--sweep-seeds", default="0,1", help="seeds at the other load scales")
    ap.add_argument("--sweep-workers", default="4", help="worker counts at the other load scales")
    add_cost_args(ap)
    ap.add_argument("--rate-chat", type=float, default=0.75, help="chat requests per virtual second per worker")
    ap.add_argument("--rate-trace", type=float, default=1.0, help="trace requests per virtual second per worker")
    ap.add_argument("--conversations", type=int, default=40, help="chat conversations per seed (every worker count)")
    ap.add_argument("--answer-tokens", default="50,400", help="chat answer length range [lo, hi) (the generator's)")
    ap.add_argument(
        "--open-conversations", type=int, default=0, help="chat conversations open at once (default: all of them)"
    )
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--trace-requests", type=int, default=500, help="trace records per seed (every worker count)")
    ap.add_argument("--trace-stride", type=int, default=1000, help="seed s reads records from s * stride")
    ap.add_argument(
        "--trace-block-tokens",
        type=int,
        default=64,
        help="tokens per 512-token trace block; prompts AND the model's window scale with it",
    )
    ap.add_argument("--trace-prompt-max", type=int, default=4096)
    ap.add_argument("--trace-output-max", type=int, default=16)
    ap.add_argument("--l1-frac", type=float, default=0.5, help="aggregate L1 bytes / working-set bytes")
    ap.add_argument("--l2-per-l1", type=float, default=3.0, help="L2 (host) bytes per worker / L1 bytes")
    ap.add_argument("--l1-swa-ratio", type=float, default=0.25, help="device SWA pages per full page")
    ap.add_argument("--l2-swa-ratio", type=float, default=0.25, help="host SWA pages per full page")
    ap.add_argument("--l3", action="store_true", help="one shared gcache-server as L3 (--l3-frac x working set)")
    ap.add_argument("--l3-frac", type=float, default=2.0)
    ap.add_argument(
        "--h2d-gbps",
        type=float,
        default=0.0,
        help="host -> device copy rate charged for L2 loads (default: measured now, one numpy copy)",
    )
    ap.add_argument("--tick-s", type=float, default=0.1, help="virtual seconds between publish + refresh")
    ap.add_argument(
        "--knobs",
        default="",
        metavar="NAME=VALUE,...",
        help="RouterConfig fields for every router (tuning; default: the RouterConfig defaults)",
    )
    ap.add_argument("--routers", type=int, default=1, help="routers the requests alternate between")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes, one redis-server each)")
    ap.add_argument("--check-every", type=int, default=0, help="engine.check_integrity() every N steps")
    ap.add_argument("--no-swa-case", action="store_true", help="skip the SWA mis-routing case")
    ap.add_argument("--real", action="store_true", help="only the real-process run (bench/router/real.py)")
    ap.add_argument("--real-policies", default="least_load,cache_aware")
    ap.add_argument("--real-conversations", type=int, default=6)
    ap.add_argument("--real-turns", type=int, default=4)
    ap.add_argument("--real-max-tokens", type=int, default=24)
    ap.add_argument("--real-kv-mib", type=float, default=32.0, help="each worker's --kv-budget-mib and --l2-mib")
    ap.add_argument("--real-seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.workers, args.conversations, args.trace_requests = "0", "2", 8, 24
        args.load_scales = args.load_scales or "1"
        args.sweep_seeds, args.sweep_workers = "0", args.workers
        args.cal_repeats = 1
    args.load_scales = args.load_scales or "1,2"
    return args


def build_workload(name: str, seed: int, args):
    if name == "chat":
        lo, hi = (int(x) for x in args.answer_tokens.split(","))
        return chat_turns(
            seed, args.conversations, output_tokens=(lo, hi), concurrency=args.open_conversations or args.conversations
        )
    return trace_slice(
        args.trace,
        seed * args.trace_stride,
        args.trace_requests,
        args.trace_block_tokens,
        args.trace_prompt_max,
        args.trace_output_max,
    )


def budgets_for(turns, cfg: ModelConfig, workers: int, args, checkpoint_pages: int) -> tuple[Budgets, dict]:
    hits, pages = oracle_hit_tokens(turns, cfg.page_size)
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    ws = pages * bf
    longest = max(-(-(len(t.prompt) + t.max_tokens) // cfg.page_size) for t in turns)
    floor = int((longest + 64) * (bf + bs * args.l1_swa_ratio) * 1.1)
    l1 = max(int(args.l1_frac * ws / workers), floor)
    b = Budgets(
        l1, int(args.l2_per_l1 * l1), int(args.l3_frac * ws), args.l1_swa_ratio, args.l2_swa_ratio, checkpoint_pages
    )
    prompt_tokens = sum(len(t.prompt) for t in turns)
    info = {
        "requests": len(turns),
        "prompt_tokens": prompt_tokens,
        "pages": pages,
        "ws_bytes": ws,
        "longest_pages": longest,
        "l1_raised": l1 > int(args.l1_frac * ws / workers),
        "oracle_hit": sum(hits) / prompt_tokens,
        "conversations": sum(t.after < 0 for t in turns),
    }
    return b, info


def checkpoint_pages(name: str, cfg: ModelConfig, args) -> int:
    """chat: request ends and branch points only; trace: also one per trace block."""
    return 0 if name == "chat" else max(1, args.trace_block_tokens // cfg.page_size)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    print("command: .venv/bin/python -m bench.router.policies " + " ".join(argv))
    if args.real:
        from bench.router.real import run_real

        return {"real": run_real(args)}
    cost, cost_text = load_cost(args, "fitted to the real numpy model here")
    print(f"compute clock: {cost_text}")
    if args.quick:
        print("--quick: tiny workloads, one seed: a check that everything runs, not the figures")
    scales = [float(x) for x in args.load_scales.split(",") if x]
    seeds_at = {sc: [int(s) for s in (args.seeds if sc == scales[0] else args.sweep_seeds).split(",")] for sc in scales}
    seeds = sorted(set().union(*seeds_at.values()))
    workers = [int(w) for w in args.workers.split(",")]
    names = [n for n in args.workloads.split(",") if n]
    policies = [p for p in args.policies.split(",") if p]
    sched = SchedulerConfig(max_tokens_per_step=512, chunk_tokens=256)
    st = {
        "args": args,
        "sched": sched,
        "cost": cost,
        "cfg": {n: model_for(n, args) for n in names},
        "policies": policies,
        "turns": {},
        "budgets": {},
        "info": {},
        "seeds_at": seeds_at,
        "rate": {"chat": args.rate_chat, "trace": args.rate_trace},
    }
    for name in names:
        cfg = st["cfg"][name]
        for seed in seeds:
            turns = build_workload(name, seed, args)
            for w in workers:
                st["turns"][(name, seed, w)] = turns
                st["budgets"][(name, seed, w)], st["info"][(name, seed, w)] = budgets_for(
                    turns, cfg, w, args, checkpoint_pages(name, cfg, args)
                )
    sweep_workers = {int(w) for w in args.sweep_workers.split(",") if w}
    st["points"] = [(w, sc) for w in workers for sc in scales if sc == scales[0] or w in sweep_workers]
    jobs = [Job(n, s, p, w, sc) for n in names for w, sc in st["points"] for s in seeds_at[sc] for p in policies]
    results = run_all(jobs, st)
    out = {"runs": results, "info": st["info"]}
    for name in names:
        print_workload(name, seeds_at, workers, policies, results, st)
    if not args.no_swa_case:
        from bench.router.swa_case import run_swa_case

        out["swa_case"] = run_swa_case(st)
    out["targets"] = print_targets(out, names, seeds_at, workers, policies, st)
    print(f"\nwall time {time.perf_counter() - t_start:.0f}s")
    return out


if __name__ == "__main__":
    main()
