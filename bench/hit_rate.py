"""Effective prefix-cache hit rate at a fixed KV memory budget (simulation: no model compute,
the real SWARadixTree and PagePools).

Two ways to spend the same bytes on the same hybrid model (1 full : 6 SWA layers):
  swa-tree  full-attention KV for every cached page, SWA KV only for the window tails the
            tree needs (request ends, branch points, optional checkpoints every C pages);
            a prefix is a hit only up to its window-safe length.
  baseline  SWA KV kept for every cached page, as if the SWA layers were full attention:
            every page costs full + SWA bytes, so fewer pages fit; every prefix is usable.
Per request: match (hit = matched prompt tokens), allocate pages for the rest (evicting
from the tree when a pool is short), cache prompt (+ answer) with insert. Requests run one
at a time; the SWA pages a real engine holds only while a chunk is computed are not modelled.

  .venv/bin/python bench/hit_rate.py            # both workloads, default sizes, ~1 min
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gcache.worker.config import FULL, SWA, ModelConfig  # noqa: E402
from gcache.worker.kv_pool import DualKVCache, PagePool  # noqa: E402
from gcache.worker.swa_radix_tree import SWARadixTree  # noqa: E402
from gcache.worker.swa_window import swa_keep_pages  # noqa: E402
from workloads_chat import chat_workload, trace_workload  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/conversation_trace.jsonl"


@dataclass
class Result:
    mode: str
    full_pages: int
    swa_pages: int
    hit_tokens: int = 0
    prompt_tokens: int = 0
    dropped: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)


def pools_for(mode: str, config: ModelConfig, budget_bytes: int, swa_full_ratio: float) -> tuple[int, int]:
    if mode == "swa-tree":
        return DualKVCache.pages_for_budget(config, budget_bytes, swa_full_ratio)
    pages = budget_bytes // (DualKVCache.page_bytes(config, FULL) + DualKVCache.page_bytes(config, SWA))
    return pages, pages


def simulate(mode: str, requests, config: ModelConfig, budget_bytes: int, swa_full_ratio: float,
             checkpoint_pages: int, nodes_max: int) -> Result:
    ps, window = config.page_size, config.window
    full_n, swa_n = pools_for(mode, config, budget_bytes, swa_full_ratio)
    tree = SWARadixTree(ps, window, PagePool(full_n, FULL), PagePool(swa_n, SWA), nodes_max)
    res = Result(mode, full_n, swa_n)
    t0 = time.perf_counter()
    for req in requests:
        m = tree.match(req.prompt)
        res.prompt_tokens += len(req.prompt)
        res.hit_tokens += m.prefix_len
        tree.lock(m.node)
        n, done = len(req.cached) // ps, m.prefix_len // ps
        if mode == "swa-tree":
            keep = swa_keep_pages(n, ps, window, [m.present_len // ps], checkpoint_pages)
            swa_idx = sorted(i for i in keep if i >= done)
        else:
            swa_idx = list(range(done, n))
        short_f = max(0, n - done - tree.full_pool.num_free)
        short_s = max(0, len(swa_idx) - tree.swa_pool.num_free)
        if short_f or short_s:
            tree.evict(short_f, short_s)
        full = tree.full_pool.alloc(n - done)
        swa = tree.swa_pool.alloc(len(swa_idx)) if full is not None else None
        if swa is None:  # larger than everything the tree could give back
            if full is not None:
                tree.full_pool.free(full)
            tree.unlock(m.node)
            res.dropped += 1
            continue
        by_page = dict(zip(swa_idx, swa))
        swa_table = list(m.swa_pages) + [by_page.get(i) for i in range(done, n)]
        tree.insert(req.cached[: n * ps], list(m.full_pages) + full, swa_table)
        tree.unlock(m.node)
    res.seconds = time.perf_counter() - t0
    tree.check_integrity([], [])
    return res


def run_workload(name: str, make_requests, config: ModelConfig, args, checkpoint_pages: int):
    chat = name == "chat"
    budget = int((args.budget_mib if chat else args.trace_budget_mib) * 2**20)
    ratio = args.chat_swa_full_ratio if chat else args.trace_swa_full_ratio
    rows = []
    for mode in ("swa-tree", "baseline"):
        rows.append(simulate(mode, make_requests(), config, budget, ratio, checkpoint_pages, args.nodes_max))
    tree, base = rows
    bf = DualKVCache.page_bytes(config, FULL)
    bs = DualKVCache.page_bytes(config, SWA)
    print(f"\n{name}: page {config.page_size} tokens, W={config.window}, budget {budget / 2**20:.0f} MiB, "
          f"bytes/page full {bf} swa {bs}, swa:full pages {ratio}, checkpoint every {checkpoint_pages or '-'} pages, "
          f"{tree.prompt_tokens} prompt tokens")
    print(f"  {'mode':<9} {'full pages':>10} {'swa pages':>10} {'tokens fit':>10} {'hit rate':>9} "
          f"{'dropped':>7} {'sim s':>6}")
    for r in rows:
        print(f"  {r.mode:<9} {r.full_pages:>10} {r.swa_pages:>10} {r.full_pages * config.page_size:>10} "
              f"{r.hit_rate:>9.2%} {r.dropped:>7} {r.seconds:>6.1f}")
    gain = tree.hit_rate / base.hit_rate if base.hit_rate else float("inf")
    print(f"  ratio swa-tree / baseline hit rate: {gain:.2f}x")
    return name, tree, base, gain


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=float, default=96, help="KV budget, chat workload")
    ap.add_argument("--trace-budget-mib", type=float, default=16384, help="KV budget, trace replay")
    ap.add_argument("--chat-swa-full-ratio", type=float, default=0.1,
                    help="SWA pages per full page in the swa-tree pools (SGLang's --swa-full-tokens-ratio)")
    ap.add_argument("--trace-swa-full-ratio", type=float, default=0.2,
                    help="the same for the trace (its block checkpoints keep more SWA)")
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-checkpoint-pages", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--trace-requests", type=int, default=3000, help="first N records (12031 in all)")
    ap.add_argument("--trace-page-size", type=int, default=64,
                    help="a 512-token trace block is 512/this pages; W stays 128")
    ap.add_argument("--trace-checkpoint-pages", type=int, default=8,
                    help="SWA checkpoint every N pages (8 = every trace block)")
    ap.add_argument("--nodes-max", type=int, default=200_000)
    ap.add_argument("--only", choices=("chat", "trace"), default=None)
    args = ap.parse_args(argv)
    print("command:", " ".join([".venv/bin/python", *sys.argv]))
    out = []
    if args.only in (None, "chat"):
        cfg = ModelConfig()
        out.append(run_workload("chat", lambda: chat_workload(args.seed, args.conversations), cfg, args,
                                args.chat_checkpoint_pages))
    if args.only in (None, "trace"):
        cfg = ModelConfig(page_size=args.trace_page_size)
        out.append(run_workload("trace", lambda: trace_workload(args.trace, args.trace_requests), cfg, args,
                                args.trace_checkpoint_pages))
    print("\nsummary")
    print(f"  {'workload':<8} {'swa-tree':>9} {'baseline':>9} {'ratio':>6}")
    for name, tree, base, ratio in out:
        print(f"  {name:<8} {tree.hit_rate:>9.2%} {base.hit_rate:>9.2%} {ratio:>5.2f}x")


if __name__ == "__main__":
    main()
