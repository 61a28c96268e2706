"""The cache hierarchy bench (bench.hicache): token hit rate per tier, TTFT, recomputation and L3 bytes of the cache
hierarchy, for 1, 2 and 4 workers sharing one L3, against two baselines.

What is real: the Engine (scheduler, SWA radix tree, dual device pools), TieredPrefixCache with its
HostCache / host pool (L2) and L3Store + gcache.Client, and one gcache-server per run as
the shared L3 (--memory = the L3 byte budget, plus a small --disk tier, printed). What is
simulated: compute (SimulatedModel with the CostModel fitted to the real numpy model, as
bench/worker/ttft.py --mode real does; --cost default for a quick unfitted one) and the time of
the copies, charged on each worker's virtual clock:
  * L2 -> L1 loads: bytes / the host -> device bandwidth measured here (one large numpy
    copy), added to the step that loads them (serially: no layer-wise overlap credit);
  * L3 reads: a prefetch started at virtual time t is done at t + round trips x RTT +
    bytes / the loopback GET throughput measured here against a gcache-server with the
    same flags; prefetch policy wait_complete, so the request is admitted after that.
The model emits each request's scripted answer (greedy), so a later turn's prompt really
extends what the engine cached; max_tokens = the answer's length.

Workers: 1, 2, 4 engines, each with its own device pools and L2, sharing the L3 server;
requests go to workers at random (seeded), so a conversation's turns move between
workers. The engines are stepped as a discrete-event simulation over their virtual
clocks (bench/hicache/cluster.py). Arrivals: a seeded Poisson schedule at --rate requests
per second PER WORKER (so each worker sees the same load whatever the worker count), in
workload order, except that a turn is never sent before the previous turn of its
conversation has finished (closed loop per conversation).

Configurations, same byte budgets (L1 and L2 per worker, L3 shared):
  L1                 device pools only (SWA pool = --l1-swa-ratio x full pages)
  L1+L2              + host pool of --l2 bytes
  L1+L2+L3           + the shared gcache-server
  SWA-unaware        L1+L2+L3 keeping SWA KV for every page in every tier: swa_checkpoint_pages=1,
                     device and host pools split so the SWA pool has as many pages as the full one
  SGLang-style L1    device only, with bench/hicache/sglang_tree.py's tree (a match ends only at a
                     node boundary whose window holds no SWA tombstone)
Budgets come from the workload's working set WS (distinct pages x full-KV page bytes): L1
= --l1-frac x WS per worker (raised if needed so the SWA-unaware split can hold the longest
request), L2 = --l2-per-l1 x L1 per worker, L3 = --l3-frac x WS; defaults 0.25, 2, 2: a
hierarchy under pressure. With generous budgets (e.g. --l2-per-l1 4 --l3-frac 4) every
configuration with an L3 converges to the oracle and the differences vanish.

Trace: bench.common.workloads.trace_workload turns each 512-token block into --trace-block-tokens
tokens; the model's window is scaled by the same factor (64 tokens: W=16), so a block still
spans 4 windows as in the real trace, and checkpoints are kept once per block by default.

Targets (issue 8): cached prefix tokens held per KV byte >= 5x the SWA-unaware hierarchy at
8K+ token contexts (a separate run of long conversations, nothing evicted); hit rate at a
fixed byte budget above both baselines; 4 workers sharing L3 on chat >= 90% of the token
hit rate of an infinite single cache (the exact oracle: the longest page-aligned prefix of
each prompt that any earlier request computed, SWA or not).

  .venv/bin/python -m bench.hicache.hierarchy           # both workloads, 3 seeds, ~5 min on 2 cores
  .venv/bin/python -m bench.hicache.hierarchy --quick   # ~30 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from bench.common.paths import CONVERSATION_TRACE  # noqa: E402
from bench.hicache.cluster import Budgets, Setup, simulate  # noqa: E402
from bench.hicache.measure import density, measure_timing, start_server, stop_server  # noqa: E402
from bench.hicache.report import print_density, print_targets, print_workload  # noqa: E402
from bench.hicache.sglang_tree import SGLangSWATree  # noqa: E402
from bench.hicache.workloads import chat_turns, model_for, oracle_hit_tokens, trace_turns  # noqa: E402
from bench.worker.ttft_cost import add_cost_args, load_cost  # noqa: E402
from gcache.common.attention import AttentionKind  # noqa: E402
from gcache.common.units import MiB
from gcache.worker.config import ModelConfig  # noqa: E402
from gcache.worker.engine.scheduler import SchedulerConfig  # noqa: E402
from gcache.worker.kvcache.kv_pool import DualKVCache  # noqa: E402

TRACE = CONVERSATION_TRACE
SETUPS = (
    Setup("L1"),
    Setup("L1+L2", l2=True),
    Setup("L1+L2+L3", l2=True, l3=True),
    Setup("SWA-unaware", l2=True, l3=True, swa_unaware=True),
    Setup("SGLang-style L1", tree_cls=SGLangSWATree, periodic_checkpoints=False),
)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small workloads, one seed: ~30 s")
    ap.add_argument("--workloads", default="chat,trace")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--setups", default=",".join(s.name for s in SETUPS))
    add_cost_args(ap)
    ap.add_argument(
        "--rate", type=float, default=0.0, help="requests per virtual second per worker (default: 0.5 chat, 0.25 trace)"
    )
    ap.add_argument("--conversations", type=int, default=60, help="chat conversations per seed")
    ap.add_argument("--answer-tokens", default="20,120", help="chat answer length range [lo, hi)")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--trace-requests", type=int, default=400, help="first N trace records (12031 in all)")
    ap.add_argument(
        "--trace-block-tokens",
        type=int,
        default=64,
        help="tokens per 512-token trace block; prompts AND the model's window scale with it",
    )
    ap.add_argument("--trace-prompt-max", type=int, default=4096, help="trace prompts are cut here")
    ap.add_argument("--trace-output-max", type=int, default=16, help="most tokens a trace request generates")
    ap.add_argument("--l1-frac", type=float, default=0.25, help="L1 bytes per worker / working-set bytes")
    ap.add_argument("--l2-per-l1", type=float, default=2.0, help="L2 bytes per worker / L1 bytes")
    ap.add_argument("--l3-frac", type=float, default=2.0, help="L3 server --memory / working-set bytes")
    ap.add_argument("--l3-disk-frac", type=float, default=0.0625, help="L3 server --disk / its --memory")
    ap.add_argument("--l1-swa-ratio", type=float, default=0.25, help="device SWA pages per full page")
    ap.add_argument("--l2-swa-ratio", type=float, default=0.25, help="host SWA pages per full page")
    ap.add_argument(
        "--checkpoint-pages",
        type=int,
        default=0,
        help="chat: SWA checkpoint every C pages besides request ends and branch points (0: none)",
    )
    ap.add_argument(
        "--trace-checkpoint-pages", type=int, default=-1, help="trace: the same (default -1: one per trace block)"
    )
    ap.add_argument("--long-conversations", type=int, default=3, help="8-16K-token conversations (density)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    ap.add_argument("--check-every", type=int, default=0, help="engine.check_integrity() every N steps")
    ap.add_argument("--plot", default="", help="also draw the token hit rate per tier per configuration (PNG)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.conversations, args.trace_requests = "0", 16, 100
        args.long_conversations, args.cal_repeats = 1, 1
    return args


def build_workload(name: str, seed: int, args):
    if name == "chat":
        lo, hi = (int(x) for x in args.answer_tokens.split(","))
        return chat_turns(seed, args.conversations, output_tokens=(lo, hi))
    return trace_turns(
        args.trace, args.trace_requests, args.trace_block_tokens, args.trace_prompt_max, args.trace_output_max
    )


def checkpoint_pages(name: str, cfg: ModelConfig, args) -> int:
    if name == "chat":
        return args.checkpoint_pages
    if args.trace_checkpoint_pages >= 0:
        return args.trace_checkpoint_pages
    return max(1, args.trace_block_tokens // cfg.page_size)


def budgets_for(turns, cfg: ModelConfig, args, ckpt: int) -> tuple[Budgets, dict]:
    """Byte budgets from the working set; L1 raised to hold the longest request in the
    SWA-unaware split (its pools take full + SWA bytes for every page)."""
    hits, pages = oracle_hit_tokens(turns, cfg.page_size)
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    ws = pages * bf
    longest = max(-(-(len(t.prompt) + t.max_tokens) // cfg.page_size) for t in turns)
    l1_floor = (longest + 64) * (bf + bs)
    l1 = max(int(args.l1_frac * ws), l1_floor)
    b = Budgets(l1, int(args.l2_per_l1 * l1), int(args.l3_frac * ws), args.l1_swa_ratio, args.l2_swa_ratio, ckpt)
    info = {
        "requests": len(turns),
        "prompt_tokens": sum(len(t.prompt) for t in turns),
        "pages": pages,
        "ws_bytes": ws,
        "ws_unaware_bytes": pages * (bf + bs),
        "longest_pages": longest,
        "l1_raised": l1 > int(args.l1_frac * ws),
        "oracle_hit": sum(hits) / sum(len(t.prompt) for t in turns),
        "conversations": sum(t.after < 0 for t in turns),
    }
    return b, info


# Runs are independent processes (fork); these hold what they read.
_JOB_STATE: dict = {}


def run_job(job) -> tuple:
    name, seed, setup_name, workers = job
    st = _JOB_STATE
    turns, budgets = st["turns"][(name, seed)], st["budgets"][(name, seed)]
    setup = next(s for s in SETUPS if s.name == setup_name)
    srv = root = None
    if setup.l3:
        srv, root = start_server(budgets.l3_bytes, int(budgets.l3_bytes * st["args"].l3_disk_frac))
    try:
        res = simulate(
            turns,
            st["cfg"][name],
            setup,
            budgets,
            workers,
            st["sched"],
            st["cost"],
            st["timing"],
            srv.address if srv else "",
            st["rate"][name],
            seed,
            st["args"].check_every,
        )
    except Exception as e:
        raise RuntimeError(f"run {job} failed: {e!r}") from e
    finally:
        if srv is not None:
            stop_server(srv, root)
    return job, res


def _exit_on_sigterm() -> None:
    """Pool workers: a SIGTERM (the pool ends early when a run fails) unwinds the run, so
    its gcache-server is stopped rather than orphaned."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))


def run_all(jobs: list, processes: int) -> dict:
    if processes <= 1:
        return dict(run_job(j) for j in jobs)
    import multiprocessing as mp

    # Longest runs first, so the two processes finish together.
    order = sorted(jobs, key=lambda j: (-j[3], -(("L3" in j[2]) + ("unaware" in j[2]))))
    with mp.get_context("fork").Pool(processes, initializer=_exit_on_sigterm) as pool:
        return dict(pool.imap_unordered(run_job, order))


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    print("command: .venv/bin/python -m bench.hicache.hierarchy " + " ".join(argv))
    cfg = ModelConfig(dtype="float32")
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    print(
        f"model: {cfg.layers} layers ({len(cfg.full_layers)} full, {len(cfg.swa_layers)} SWA), W={cfg.window}, "
        f"page {cfg.page_size} tokens; KV bytes per page: full {bf}, SWA {bs} "
        f"(SWA KV on every page costs {(bf + bs) / bf:.1f}x full-only)"
    )
    cost, cost_text = load_cost(args)
    print(f"compute clock: {cost_text}")
    if args.quick:
        print("--quick: small workloads and one seed; a check that everything runs, not the figures")
    sched = SchedulerConfig(max_tokens_per_step=512, chunk_tokens=256)
    seeds = [int(s) for s in args.seeds.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    names = [n for n in args.workloads.split(",") if n]
    setups = [s for s in SETUPS if s.name in args.setups.split(",")]
    st = _JOB_STATE
    st.update(
        args=args,
        cfg={n: model_for(n, args) for n in names},
        sched=sched,
        cost=cost,
        turns={},
        budgets={},
        info={},
        rate={"chat": args.rate or 0.5, "trace": args.rate or 0.25},
    )
    for name in names:
        for seed in seeds:
            turns = build_workload(name, seed, args)
            st["turns"][(name, seed)] = turns
            wcfg = st["cfg"][name]
            st["budgets"][(name, seed)], st["info"][(name, seed)] = budgets_for(
                turns, wcfg, args, checkpoint_pages(name, wcfg, args)
            )
    l3_probe = next(iter(st["budgets"].values())) if st["budgets"] else Budgets(64 * MiB, 0, 64 * MiB)
    timing = measure_timing(cfg, l3_probe.l3_bytes, int(l3_probe.l3_bytes * args.l3_disk_frac))
    st["timing"] = timing
    print(
        f"copy times charged on the virtual clock, rates measured now: host->device "
        f"{timing.h2d_bytes_per_s / 1e9:.2f} GB/s (one 256 MiB numpy copy), charged serially on the step that "
        f"loads (no layer-wise overlap credit); "
        f"L3 GET {timing.l3_bytes_per_s / 1e9:.2f} GB/s and round trip {timing.l3_rtt_s * 1e6:.0f} us (loopback, "
        f"batch_get_into of 128 full + 9 SWA pages, a gcache-server with the runs' flags): an L3 prefetch takes "
        f"3 round trips + bytes / GET rate (a miss 1 round trip) and a waiting request is admitted after it "
        f"(wait_complete); L3 writes cost no virtual time (off the critical path)"
    )
    jobs = [(n, s, su.name, w) for n in names for s in seeds for su in setups for w in workers]
    results = run_all(jobs, args.jobs)
    out = {"runs": results, "info": st["info"], "timing": timing}
    for name in names:
        print_workload(name, seeds, workers, setups, results, st, args)
    if args.long_conversations:
        d = density(cfg, cost, timing, seeds[0], args.long_conversations, sched)
        print_density(d, cfg)
        out["density"] = d
    out["targets"] = print_targets(out, names, seeds, workers, setups)
    if args.plot:
        plot_tiers(results, names, seeds, workers, setups, args.plot)
    print(f"\nwall time {time.perf_counter() - t_start:.0f}s")
    return out


def plot_tiers(results, names, seeds, workers, setups, path: str) -> None:
    """One panel per workload and worker count: a stacked bar per configuration, the
    median token hit rate of each tier (L1, L2, L3) over the seeds."""
    from gcache.tools.plotting import charts

    plt = charts.pyplot()
    panels = [(n, w) for n in names for w in workers]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(max(4.5, 0.8 * len(setups) + 1.5) * len(panels), 4), squeeze=False
    )
    colors = {"l1": "#2b6cb0", "l2": "#63b3ed", "l3": "#dd6b20"}
    for ax, (name, w) in zip(axes[0], panels):
        bottom = [0.0] * len(setups)
        for tier in ("l1", "l2", "l3"):
            heights = [
                float(statistics.median([results[(name, s, su.name, w)].tier_hit(tier) for s in seeds]))
                for su in setups
            ]
            ax.bar(range(len(setups)), heights, bottom=bottom, color=colors[tier], label=tier.upper())
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(range(len(setups)))
        ax.set_xticklabels([su.name for su in setups], rotation=25, ha="right", fontsize=8)
        ax.set_title(f"{name}, {w} worker{'s' if w > 1 else ''}", fontsize=10)
        ax.set_ylabel("token hit rate")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    charts.save(fig, path)


if __name__ == "__main__":
    main()
