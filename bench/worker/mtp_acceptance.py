"""MTP draft acceptance and tokens per forward by output position, after an L3 hit on a second
worker, for the four places a request's MTP KV can come from (EngineConfig.mtp_prefix):

  none     no MTP KV at prefill: the MTP blocks start at the first sampled token (what the
           production report's prefill did);
  prefill  MTP KV built at prefill for the tokens the worker computes, none for a cached
           prefix (MTP KV not kept in L2/L3: the prefix came from L3 without it);
  rebuild  the cached prefix's MTP window rebuilt at admission from its KV (which came from
           L3): the MTP blocks see the same window as if the prefix had been computed here.
  tiers    MTP KV kept through every tier: the checkpoint's MTP tail (the `mtp` pool) came
           from L3 with the prefix and is restored exactly (no rebuild forward).
  stale    none, as engines without MTP state really run it: the MTP blocks read their window's
           KV slots as if valid, and the slots hold what the last request left (the production
           report's prefill);
  stale-prefix  prefill, the cached prefix's window read from stale slots (SGLang's draft pool
           on a HiCache hit before sglang#21125, vLLM's offload connector).
none and prefill mask the positions without MTP KV: stronger baselines than any engine
runs (it would have to know which slots are stale), shown so no gain rests on the stale ones.

Setup: a real gcache-server is L3; worker A (L1 + L2 + L3, MTP on, mode tiers) computes
every prompt and its L3 writes (pages and MTP tails) finish; for each mode a fresh worker B (same model name, empty L1/L2) gets each
prompt + a new question (after one unrelated warm-up request, the same for every mode, so
its slots hold another request's KV as a worker in service does): its prefix comes from L3; it decodes --tokens greedy tokens with K
MTP drafts per step. Greedy output is checked equal across modes and to decoding without
MTP. Prompts: held-out files of the standard library (every 20th .py in sorted order, the
ones gcache.tools.train_mtp does not train on), their first --prompt-bytes bytes.

Acceptance = drafts accepted / drafts proposed, tokens per forward = tokens emitted / decode
forwards, both per output-position bucket, measured for real (engine counters). Speedup is on a
compute clock, not measured: a decode forward of K + 1 tokens per request costs what one of 1
token costs (small batches are memory-bound on a GPU), an MTP block costs 1/L of a main
forward (L = the model's layers), a rebuild costs one forward at admission (not in the
ratio: once per request), tiers reads one tail per hit (bytes printed); speedup = tokens
per forward / (1 + K / L), against 1 token per forward without MTP. min / median / max over
the prompts, ratios against `none` in the same run, then each bucket pooled over the prompts
(all its drafts together: the steadier figure for 0-128 against 128-256). --seed moves every
sampling seed (a second run); --ablate-mtp-window zeroes the MTP blocks' attention output: a
model whose acceptance does not drop then gains nothing from MTP KV, whatever its source.

  .venv/bin/python -m bench.worker.mtp_acceptance        # shipped weights; ~2-4 min on 2 cores
  .venv/bin/python -m bench.worker.mtp_acceptance --preset tiny-mtp-recur --prompts 12
      # the preset whose MTP drafts read their window (gcache.tools.train_mtp, README)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from bench.common.stats import columns
from bench.worker.stale_mtp import STALE_MODES, stale_decoding
from gcache.tools.devcluster.local_server import LocalServer
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.http.flags import SHIPPED_WEIGHTS
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.mtp import MTPHead
from gcache.worker.model.transformer import Model
from gcache.worker.model.weights import load

PRESET = SHIPPED_WEIGHTS["tiny-mtp"]
MODES = ("stale", "stale-prefix", "none", "prefill", "rebuild", "tiers")
BUCKETS = ("0_128", "128_256")


def prompts(n: int, nbytes: int) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    out = []
    for i, p in enumerate(files):
        if i % 20 != 19:
            continue
        data = p.read_bytes()
        if len(data) >= nbytes + 64:
            out.append(list(data[:nbytes]))
        if len(out) == n:
            break
    return out


def engine(model, cfg, l3: str, name: str, mtp: int, mode: str) -> Engine:
    sc = SchedulerConfig(max_tokens_per_step=512, chunk_tokens=256, max_running=4)
    hc = TieredCacheConfig(l2_bytes=64 << 20, l3_url=l3, model_name=name, prefetch_policy="wait_complete")
    stale = mode in STALE_MODES  # the peers' baselines: a bench strategy (bench/worker/stale_mtp.py)
    ec = EngineConfig(
        max_prompt_tokens=4096,
        max_new_tokens=512,
        mtp_layers=mtp,
        mtp_prefix=STALE_MODES[mode] if stale else mode,
        scheduler=sc,
        cache_config=hc,
    )
    decoding = stale_decoding(mtp, mode) if stale else None
    return Engine(model, DualKVCache.from_budget(cfg, 64 << 20, 0.5), ec, decoding=decoding)


@contextlib.contextmanager
def ablated_mtp_window():
    """While open, the MTP blocks' attention output times 0 (MTPHead.window_attention: the
    diagnostic of --ablate-mtp-window; tests/worker/test_mtp_presets.py uses it too)."""
    before = MTPHead.window_attention
    MTPHead.window_attention = False
    try:
        yield
    finally:
        MTPHead.window_attention = before


def serve(e: Engine, prompt, max_tokens: int, temperature: float = 0.0, seed: int = 0):
    r = e.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
    e.run_until_idle()
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset",
        choices=tuple(SHIPPED_WEIGHTS),
        default="tiny-mtp",
        help="shipped weights: tiny-mtp (its MTP blocks do not read their window) or tiny-mtp-recur (they do)",
    )
    ap.add_argument("--weights", default="", help="another .npz (instead of --preset)")
    ap.add_argument("--mtp-layers", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-bytes", type=int, default=1450)
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded per request")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="0: greedy (the tiny model falls into loops its MTP blocks predict perfectly); > 0: "
        "rejection sampling, seeded per prompt (then the greedy equality is checked on a short run)",
    )
    ap.add_argument("--seed", type=int, default=0, help="offset of the per-prompt sampling seeds (one run per seed)")
    ap.add_argument(
        "--ablate-mtp-window",
        action="store_true",
        help="diagnostic: zero the MTP blocks' attention output (they then read no window at all); "
        "where acceptance stays the same, the model's drafts do not depend on MTP KV, whatever its source",
    )
    args = ap.parse_args(argv)
    with ablated_mtp_window() if args.ablate_mtp_window else contextlib.nullcontext():
        run(args)


def run(args: argparse.Namespace) -> None:
    print("command:", " ".join([".venv/bin/python", "-m", "bench.worker.mtp_acceptance", *sys.argv[1:]]))
    args.weights = args.weights or str(SHIPPED_WEIGHTS[args.preset])
    cfg, weights = load(args.weights)
    model = Model(cfg, weights)
    K, L = args.mtp_layers, cfg.layers
    print(
        f"model {args.weights}: {L} layers, hidden {cfg.hidden}, W {cfg.window}, {cfg.mtp_layers} MTP blocks; K = {K}"
    )
    ps = prompts(args.prompts + 1, args.prompt_bytes)
    warm, ps = ps[-1][:400], ps[:-1]  # another held-out file: shares no page with any prompt
    question = list(b"\n\n# Question: what does this module do?\n")
    root = Path(tempfile.mkdtemp(prefix="mtp-bench-"))
    srv = LocalServer(root / "data", memory=str(256 << 20), disk=str(64 << 20)).start()
    t0 = time.monotonic()
    try:
        name = "mtp-bench"
        tails: list = []
        plain = [
            serve(engine(model, cfg, "", name + "-plain", 0, "prefill"), p + question, args.tokens).output for p in ps
        ]
        res: dict = {m: {b: [] for b in BUCKETS} for m in MODES}
        pooled: dict = {m: {b: [0, 0, 0, 0] for b in BUCKETS} for m in MODES}  # accepted, drafted, emitted, forwards
        for mode in MODES:
            # worker A per mode, under its own model name: every mode's hit is at A's checkpoint
            # (B workers of an earlier mode would leave longer prefixes, without tails, in L3)
            a = engine(model, cfg, srv.address, f"{name}-{mode}", K, "tiers")
            for p in ps:
                serve(a, p, 1)
            assert a.cache.l3.drain(timeout_s=60.0), "L3 writes still queued"
            tails = list(a.cache.mtp.l1.blobs.values())
            assert tails, "worker A wrote no MTP tails"
            a.close()
            for i, p in enumerate(ps):
                b = engine(model, cfg, srv.address, f"{name}-{mode}", K, mode)
                serve(b, warm, 64, args.temperature, seed=1000 + args.seed + i)
                s0 = b.metrics.snapshot()  # the figures below are the measured request's alone
                r = serve(b, p + question, args.tokens, args.temperature, seed=args.seed + i)
                s1 = b.metrics.snapshot()  # before the greedy check below adds to the counters
                s = {k: v - s0.get(k, 0) for k, v in s1.items() if isinstance(v, (int, float))}
                if args.temperature == 0:
                    assert r.output == plain[i], f"{mode}: greedy output with MTP differs from without"
                else:  # the invariant on a short greedy run of the same worker (prefix in L1 now)
                    g = serve(b, p + question, 32)
                    assert g.output == plain[i][:32], f"{mode}: greedy output with MTP differs from without"
                assert r.cached_by_tier["l3"] > 0, f"{mode}: no L3 hit ({r.cached_by_tier})"
                if mode == "tiers":
                    assert s["mtp_tail_hits_l3_total"] == 1, f"tiers: the MTP tail did not come from L3 ({s})"
                    assert s["mtp_rebuilt_tokens_total"] == 0
                for bk in BUCKETS:
                    d, acc = s[f"spec_drafted_out_{bk}_total"], s[f"spec_accepted_out_{bk}_total"]
                    f, em = s[f"spec_forwards_out_{bk}_total"], s[f"spec_emitted_out_{bk}_total"]
                    if f:
                        res[mode][bk].append((acc / max(d, 1), em / f))
                        pooled[mode][bk] = [x + y for x, y in zip(pooled[mode][bk], (acc, d, em, f))]
                b.close()
    finally:
        srv.kill()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{len(ps)} prompts of {args.prompt_bytes} bytes + a {len(question)}-byte question, prefix from L3 on a second "
        f"worker, {args.tokens} tokens each at temperature {args.temperature} (seeded); greedy output == without "
        "MTP checked for every request and mode"
    )
    print(f"clock: speedup = tokens per forward / (1 + K/L) = tpf / {1 + K / L:.2f}; ran {time.monotonic() - t0:.0f} s")
    print(f"mtp pool: {len(tails)} checkpoint tails of {min(map(len, tails))}-{max(map(len, tails))} bytes each")
    print(
        f"  {'mode':<13} {'outputs':<8} {'acceptance min/med/max':>24} {'tokens/forward min/med/max':>28} {'speedup (med)':>14} {'tpf vs none':>12}"
    )
    for bk in BUCKETS:
        base = np.median([t for _, t in res["none"][bk]]) if res["none"][bk] else float("nan")
        for mode in MODES:
            rows = res[mode][bk]
            if not rows:
                continue
            acc = [x for x, _ in rows]
            tpf = [t for _, t in rows]
            med = float(np.median(tpf))
            print(
                f"  {mode:<13} {bk.replace('_', '-'):<8} {columns(acc, '{:7.3f}'):>24} {columns(tpf, '{:8.2f}'):>28} "
                f"{med / (1 + K / L):>13.2f}x {med / base:>11.2f}x"
            )
    print("pooled over the prompts (all drafts of a bucket together): acceptance, tokens/forward")
    for mode in MODES:
        (a0, d0, e0, f0), (a1, d1, e1, f1) = (pooled[mode][bk] for bk in BUCKETS)
        acc0, acc1 = a0 / max(d0, 1), a1 / max(d1, 1)
        print(
            f"  {mode:<13} 0-128 {acc0:.3f} {e0 / max(f0, 1):.2f}   128-256 {acc1:.3f} {e1 / max(f1, 1):.2f}   "
            f"acceptance 0-128 / 128-256 = {acc0 / max(acc1, 1e-9):.2f}"
        )


if __name__ == "__main__":
    main()
