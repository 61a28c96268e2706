"""Prefix-cache hit rate at a fixed KV memory budget, measured through the real engine.

Every figure comes from gcache.worker.engine.engine.Engine (scheduler, SWA radix tree, dual page
pools, the cache manager's SWA checkpoints, eviction, preemption) running over
sim_model.SimulatedModel on a VirtualClock: only the model's arithmetic is simulated. Ways
to spend the same bytes on the same hybrid model (1 full : 6 SWA layers):
  swa-tree  the engine as shipped: full-attention KV for every cached page, SWA KV only
            where the engine makes checkpoints (the window before each request end and
            branch point, and every C pages: TieredCacheConfig.swa_checkpoint_pages = C);
            pools split swa:full = --*-swa-full-ratio. A prefix hits up to its last
            window-safe checkpoint.
  swa-ends  the same with C = 0 (request ends and branch points only); shown when C > 0.
  baseline  SWA-unaware: the same engine with swa_checkpoint_pages = 1 (every page is a
            checkpoint, so SWA KV is kept for every cached page, as if the SWA layers
            were full attention) and equal full and SWA pools at the same bytes.
hit rate = prompt tokens served from the cache at admission (Request.cached_tokens) /
prompt tokens. Up to --concurrency requests are in flight. Chat: a turn is submitted once
the previous turn of its conversation has finished, and its prompt carries the engine's
own answer (the workload's answer length, the engine's tokens). Trace: arrival order
(timestamps ignored), one output token, so only the prompt is cached.

  .venv/bin/python -m bench.hicache.hit_rate   # both workloads, ~2 min on 2 cores
  .venv/bin/python -m bench.hicache.hit_rate --only chat --concurrency 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common.paths import CONVERSATION_TRACE
from bench.common.workloads import chat_workload, trace_workload
from gcache.common.attention import AttentionKind
from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.sim import SimulatedModel, VirtualClock

TRACE = CONVERSATION_TRACE
TAIL = 8  # tokens compared to find a chat turn's previous turn (verified in full after)
INTEGRITY_EVERY = 500  # engine steps between full integrity checks (and one at the end)


@dataclass(frozen=True)
class Mode:
    name: str
    checkpoint_pages: int  # TieredCacheConfig.swa_checkpoint_pages
    equal_pools: bool  # SWA pool as large as the full pool (SWA-unaware sizing)

    @property
    def assumes(self) -> str:
        if self.equal_pools:
            return "SWA KV for every cached page (the same engine, swa_checkpoint_pages=1), equal pools"
        every = f", every {self.checkpoint_pages} pages" if self.checkpoint_pages else ""
        return (
            f"SWA KV only at checkpoints the engine makes (request ends, branch points{every}; "
            f"swa_checkpoint_pages={self.checkpoint_pages})"
        )


def modes_for(checkpoint_pages: int) -> list[Mode]:
    modes = [Mode("swa-tree", checkpoint_pages, False)]
    if checkpoint_pages:
        modes.append(Mode("swa-ends", 0, False))
    return modes + [Mode("baseline", 1, True)]


@dataclass(frozen=True)
class Item:
    prompt: np.ndarray  # the workload's prompt
    out_tokens: int  # tokens the engine generates for it
    prev: int | None  # chat: index of the conversation's previous turn
    prev_len: int = 0  # tokens of the workload's prompt that are that turn's prompt + answer


@dataclass
class Result:
    mode: Mode
    full_pages: int
    swa_pages: int
    hit_tokens: int = 0
    prompt_tokens: int = 0
    by_tier: Counter = field(default_factory=Counter)
    computed_tokens: int = 0
    preemptions: int = 0
    dropped: int = 0
    steps: int = 0
    seconds: float = 0.0
    pages_seen: set = field(default_factory=set)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)


# ---- workloads -------------------------------------------------------------------------
def chat_items(requests) -> list[Item]:
    """Link each turn to its conversation's previous turn: the earlier request whose cached
    tokens (prompt + answer) the turn's prompt starts with."""
    items, open_turns, lengths = [], {}, Counter()
    for j, r in enumerate(requests):
        prev = None
        for n in sorted(lengths, reverse=True):
            if n < len(r.prompt):
                i = open_turns.get((n, r.prompt[n - TAIL : n].tobytes()))
                if i is not None and np.array_equal(items[i].prompt, r.prompt[: len(items[i].prompt)]):
                    prev = i
                    break
        prev_len = 0
        if prev is not None:
            prev_len = items[prev].prompt.size + items[prev].out_tokens
            del open_turns[(prev_len, r.prompt[prev_len - TAIL : prev_len].tobytes())]
            lengths[prev_len] -= 1
            if not lengths[prev_len]:
                del lengths[prev_len]
        items.append(Item(r.prompt, len(r.cached) - len(r.prompt), prev, prev_len))
        n = len(r.cached)
        open_turns[(n, r.cached[n - TAIL : n].tobytes())] = j
        lengths[n] += 1
    return items


def trace_items(requests) -> list[Item]:
    return [Item(r.prompt, 1, None) for r in requests]


# ---- one engine run ----------------------------------------------------------------------
def pools_for(mode: Mode, config: ModelConfig, budget_bytes: int, swa_full_ratio: float) -> tuple[int, int]:
    if not mode.equal_pools:
        return DualKVCache.pages_for_budget(config, budget_bytes, swa_full_ratio)
    pages = budget_bytes // (
        DualKVCache.page_bytes(config, AttentionKind.FULL) + DualKVCache.page_bytes(config, AttentionKind.SWA)
    )
    return pages, pages


def run_engine(mode: Mode, items: list[Item], config: ModelConfig, budget_bytes: int, ratio: float, args) -> Result:
    full_n, swa_n = pools_for(mode, config, budget_bytes, ratio)
    res = Result(mode, full_n, swa_n)
    clock = VirtualClock()
    sched = SchedulerConfig(
        max_running=args.concurrency,
        max_tokens_per_step=args.chunk_tokens * 2,
        chunk_tokens=args.chunk_tokens,
        max_waiting=args.concurrency + 1,
    )
    econf = EngineConfig(
        max_prompt_tokens=max(it.prompt.size for it in items),
        max_new_tokens=max(it.out_tokens for it in items),
        tree_nodes_max=args.nodes_max,
        scheduler=sched,
        cache_config=TieredCacheConfig(swa_checkpoint_pages=mode.checkpoint_pages),
    )
    engine = Engine(SimulatedModel(config, clock), DualKVCache(config, full_n, swa_n, xp=np), econf, clock=clock)
    answered: dict[int, np.ndarray] = {}  # chat: a finished turn's prompt + the engine's answer
    needed = {it.prev for it in items if it.prev is not None}
    pending, in_flight, done = list(range(len(items))), {}, set()
    t0 = time.perf_counter()
    try:
        while pending or in_flight:
            _submit_ready(engine, items, pending, in_flight, done, answered, res, args)
            for r in engine.step():
                i = in_flight.pop(r.rid)
                done.add(i)
                res.hit_tokens += r.cached_tokens
                res.by_tier.update(r.cached_by_tier)
                res.pages_seen.update(r.page_keys(len(r.prompt) // config.page_size))
                if i in needed:
                    answered[i] = r.tokens().copy()
            res.steps += 1
            if res.steps % INTEGRITY_EVERY == 0:
                engine.check_integrity()
        engine.check_integrity()
    finally:
        engine.close()
    snap = engine.metrics.snapshot()
    res.computed_tokens = snap["prefill_tokens_computed_total"]
    res.preemptions = snap["preemptions_total"]
    res.seconds = time.perf_counter() - t0
    return res


def _submit_ready(
    engine: Engine, items: list[Item], pending: list[int], in_flight: dict, done: set, answered: dict, res: Result, args
) -> None:
    """Submit, in workload order, pending items whose previous turn is done, up to the
    concurrency limit (looking at most --lookahead items ahead)."""
    k = 0
    while k < min(len(pending), args.lookahead) and len(in_flight) < args.concurrency:
        it = items[pending[k]]
        if it.prev is not None and it.prev not in done:
            k += 1
            continue
        i = pending.pop(k)
        prompt = it.prompt
        if it.prev in answered:  # the previous turn's prompt + the engine's own answer
            prompt = np.concatenate([answered[it.prev], it.prompt[it.prev_len :]])
        res.prompt_tokens += prompt.size
        try:
            r = engine.add_request(prompt, SamplingParams(max_tokens=it.out_tokens, temperature=0.0))
        except ValueError:  # larger than the whole pool: counted as a miss
            res.dropped += 1
            done.add(i)
            continue
        in_flight[r.rid] = i


# ---- report ------------------------------------------------------------------------------
def run_workload(name: str, items: list[Item], config: ModelConfig, args, checkpoint_pages: int):
    chat = name == "chat"
    budget = int((args.budget_mib if chat else args.trace_budget_mib) * 2**20)
    ratio = args.chat_swa_full_ratio if chat else args.trace_swa_full_ratio
    rows = [run_engine(mode, items, config, budget, ratio, args) for mode in modes_for(checkpoint_pages)]
    ps, bf, bs = (
        config.page_size,
        DualKVCache.page_bytes(config, AttentionKind.FULL),
        DualKVCache.page_bytes(config, AttentionKind.SWA),
    )
    pages = len(rows[0].pages_seen)
    print(
        f"\n{name}: {len(items)} requests, {rows[0].prompt_tokens} prompt tokens; page {ps} tokens, "
        f"W={config.window}, bytes/page full {bf} swa {bs}; budget {budget / 2**20:.0f} MiB; "
        f"swa:full pages {ratio} (swa-tree)"
    )
    print(
        f"  working set: {pages} distinct prompt pages = {pages * ps} tokens = {pages * bf / 2**20:.0f} MiB of "
        f"full KV ({pages * bf / budget:.1f}x the budget), {pages * (bf + bs) / 2**20:.0f} MiB full + SWA "
        f"({pages * (bf + bs) / budget:.1f}x)"
    )
    print(
        f"  {'mode':<9} {'full pages':>10} {'swa pages':>9} {'tokens fit':>10} {'hit rate':>8} "
        f"{'computed':>10} {'preempt':>7} {'dropped':>7} {'steps':>6} {'wall s':>6}"
    )
    for r in rows:
        print(
            f"  {r.mode.name:<9} {r.full_pages:>10} {r.swa_pages:>9} {r.full_pages * ps:>10} {r.hit_rate:>8.2%} "
            f"{r.computed_tokens:>10} {r.preemptions:>7} {r.dropped:>7} {r.steps:>6} {r.seconds:>6.1f}"
        )
    for r in rows:
        print(f"  {r.mode.name:<9} assumes: {r.mode.assumes}")
    for r in rows[:-1]:
        print(f"  ratio {r.mode.name} / baseline hit rate: {ratio_text(r, rows[-1])}")
    return name, rows


def ratio_text(r: Result, base: Result) -> str:
    return f"{r.hit_rate / base.hit_rate:.2f}x" if base.hit_rate else "- (baseline hit nothing)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=float, default=96, help="KV budget, chat workload")
    ap.add_argument(
        "--trace-budget-mib",
        type=float,
        default=16384,
        help="KV budget, trace replay (numpy pages the simulated model never touches: virtual memory)",
    )
    ap.add_argument(
        "--chat-swa-full-ratio",
        type=float,
        default=0.1,
        help="SWA pages per full page in the swa-tree pools (SGLang's --swa-full-tokens-ratio)",
    )
    ap.add_argument(
        "--trace-swa-full-ratio",
        type=float,
        default=0.2,
        help="the same for the trace (its block checkpoints keep more SWA)",
    )
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--chat-checkpoint-pages",
        type=int,
        default=0,
        help="swa-tree: TieredCacheConfig.swa_checkpoint_pages for the chat (0: ends and branch points only)",
    )
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--trace-requests", type=int, default=3000, help="first N records (12031 in all)")
    ap.add_argument(
        "--trace-page-size", type=int, default=64, help="a 512-token trace block is 512/this pages; W stays 128"
    )
    ap.add_argument(
        "--trace-checkpoint-pages",
        type=int,
        default=8,
        help="swa-tree: TieredCacheConfig.swa_checkpoint_pages for the trace (8 = every trace block)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="requests in flight (the engine's max_running); more in flight = more pool pressure",
    )
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="prefill chunk (compute is simulated)")
    ap.add_argument("--lookahead", type=int, default=64, help="pending requests scanned for one that may start")
    ap.add_argument("--nodes-max", type=int, default=200_000)
    ap.add_argument("--only", choices=("chat", "trace"), default=None)
    args = ap.parse_args(argv)
    print("command:", " ".join([".venv/bin/python", "-m", "bench.hicache.hit_rate", *sys.argv[1:]]))
    print(
        "measured through gcache.worker.engine.engine.Engine (scheduler, SWA radix tree, dual pools, SWA checkpoints, "
        "eviction, preemption) over SimulatedModel on a VirtualClock: only the model's arithmetic is "
        f"simulated; {args.concurrency} requests in flight; no L2/L3 (the budget is the device pools). "
        "Deterministic (seeded workload, virtual clock): one run per mode, a rerun prints the same figures."
    )
    out = []
    if args.only in (None, "chat"):
        items = chat_items(chat_workload(args.seed, args.conversations))
        out.append(run_workload("chat", items, ModelConfig(), args, args.chat_checkpoint_pages))
    if args.only in (None, "trace"):
        items = trace_items(trace_workload(args.trace, args.trace_requests))
        out.append(
            run_workload("trace", items, ModelConfig(page_size=args.trace_page_size), args, args.trace_checkpoint_pages)
        )
    print("\nsummary (hit rate = prompt tokens served from the prefix cache / prompt tokens)")
    for name, rows in out:
        cells = "  ".join(f"{r.mode.name} {r.hit_rate:.2%} ({ratio_text(r, rows[-1])})" for r in rows[:-1])
        print(f"  {name:<6} {cells}  baseline {rows[-1].hit_rate:.2%}")


if __name__ == "__main__":
    main()
