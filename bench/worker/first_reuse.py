"""The first reuse of a shared prefix, before and after the fix (TieredCacheConfig.swa_keep_spare).

A = S + question one (300 tokens), then B = S + question two, on an idle engine (one request at a time):
before the fix A frees its SWA KV as it leaves the window (except at checkpoints), so B
finds no window-safe point at S's end and reports cached_tokens 0; after it, the pages A
left behind stay in the tree as spare pages until the pool needs them, and B hits S's last
whole page. Then the same with an unrelated request C of the same length between A and B,
on SWA pools from roomy down to the smallest the engine accepts (where the pool cannot hold
S's pages while A runs, B misses: the pressure case); where C needs the pages,
B misses again (the behaviour before the fix). Real engine (scheduler, tree, pools) over
SimulatedModel (only the arithmetic is simulated), default model geometry (W = 128, page 16).
Deterministic: one run per cell. Hit rate at a fixed budget: bench.hicache.hit_rate.

  .venv/bin/python -m bench.worker.first_reuse      # ~10 s
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.sim import SimulatedModel, VirtualClock

Q1 = 300  # question one: longer than W plus the end's margin, so S's end is no checkpoint of A


def cached_of_b(cfg: ModelConfig, s_len: int, swa_pages: int, keep: bool, between: bool) -> int:
    clock = VirtualClock()
    sc = SchedulerConfig(max_tokens_per_step=512, chunk_tokens=256)
    hc = dataclasses.replace(TieredCacheConfig(), swa_keep_spare=keep)
    ec = EngineConfig(max_prompt_tokens=16384, max_new_tokens=64, scheduler=sc, cache_config=hc)
    full = 3 * (s_len + Q1 + 100) // cfg.page_size
    e = Engine(SimulatedModel(cfg, clock), DualKVCache(cfg, full, swa_pages), ec, clock=clock)
    rng = np.random.default_rng(s_len)
    s = [int(t) for t in rng.integers(0, 256, s_len)]
    q1, q2 = [int(t) for t in rng.integers(0, 256, Q1)], [int(t) for t in rng.integers(0, 256, 15)]
    c = [int(t) for t in rng.integers(0, 256, s_len + Q1)]
    out = 0
    for p in [s + q1] + ([c] if between else []) + [s + q2]:
        r = e.add_request(p, SamplingParams(max_tokens=16))
        try:
            e.run_until_idle(steps_max=20_000)
        except RuntimeError:
            return -1  # the engine stalled (printed as "stall")
        out = r.cached_tokens
    e.check_integrity()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="500,1450,4000", help="shared prefix S lengths (tokens)")
    args = ap.parse_args(argv)
    print("command:", " ".join([".venv/bin/python", "-m", "bench.worker.first_reuse", *sys.argv[1:]]))
    cfg = ModelConfig()
    ps = cfg.page_size
    swa_min = -(-(cfg.window + 256) // ps) + 4  # the least the engine accepts
    print(f"page {ps}, W {cfg.window}; cached_tokens of B (the first reuse); '+C': an unrelated request between")
    print(f"  {'S':>6} {'SWA pages':>10} {'before':>8} {'after':>8} {'before+C':>9} {'after+C':>8}  window-safe S")
    for s_len in (int(x) for x in args.lengths.split(",")):
        roomy = 3 * (s_len + Q1 + 100) // ps
        for swa in sorted({roomy, max(swa_min, s_len // ps // 2), swa_min}, reverse=True):
            cells = [cached_of_b(cfg, s_len, swa, keep, between) for between in (False, True) for keep in (False, True)]
            c = ["stall" if x < 0 else str(x) for x in cells]
            print(f"  {s_len:>6} {swa:>10} {c[0]:>8} {c[1]:>8} {c[2]:>9} {c[3]:>8}  {s_len // ps * ps}", flush=True)


if __name__ == "__main__":
    main()
