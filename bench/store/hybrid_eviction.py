"""Hybrid-model states through the node's real eviction (issue 38): reusable prompt tokens
when the node orders by recency (`lru`, `chain`) or also by what a value saves per byte
(`worth`: the client's PUT "worth" field, eviction/worth.h), beside the trace simulation's
clairvoyant reference and ceiling (bench/store/hybrid_states.py, same cost model).

Each request of a Mooncake-format trace is replayed in process through gcache._native.Store
(the node's storage engine and policies, no sockets) with the calls the vLLM connector makes:
EXISTS of the prompt's pages [0, hit max) (the prefix p present), EXISTS of the states at
boundaries p..1 (the hit is the deepest present: pages [0, k) and state k), then the save:
EXISTS of the full blocks' pages (the connector skips what is there), one put batch of the
missing pages, then the admitted states (`every` boundary, or `marconi`: the prompt's end and
the branch point, at most 2). With `worth` the puts carry kind + cost: a page spares 512
prefill tokens, a state at boundary k spares 512 k. Sizes: a page is 2 KiB, a state
`--state-units` pages (default 6, Qwen3-Next-80B-like); memory is `--fraction` x the working
set (every full block's page and state). Rounds: the whole trace, then each of `--windows`
consecutive slices on its own (its own working set); min/median/max are over the rounds.

    .venv/bin/python -m bench.store.hybrid_eviction                      # both traces, ~2 min at load 7
    .venv/bin/python -m bench.store.hybrid_eviction --limit 600 --windows 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench.common.paths import TRACE_DIR
from bench.store.hybrid_states import (
    BLOCK_TOKENS,
    Request,
    admitted_states,
    load_requests,
    simulate,
    working_set_units,
)
from gcache._native import Store
from gcache.wire.worth import ValueKind

UNIT = 2048  # a page's bytes; a multiple of the arena's size classes, so sizes stay exact
NODE_RUNS = (  # (label, node policy, with worth, admission)
    ("lru", "lru", False, "every"),
    ("chain", "chain", False, "every"),
    ("worth (chain + cost/byte)", "chain", True, "every"),
    ("lru + marconi admission", "lru", False, "marconi"),
    ("chain + marconi admission", "chain", False, "marconi"),
    ("worth + marconi admission", "chain", True, "marconi"),
)


def page_key(block: int) -> bytes:
    return b"p%d" % block


def state_key(block: int) -> bytes:
    return b"s%d" % block


PAGE_COST = BLOCK_TOKENS  # set by --page-cost; -1: the tokens of the chain it heads


STATE_COST = "prefix"  # set by --state-cost


def state_cost(bounds: list[int], i: int) -> int:
    """A state's cost: its whole prefix, or ("marginal") the tokens since the request's
    previous saved boundary (what a miss costs when the state before it is there)."""
    k = bounds[i]
    if STATE_COST == "marginal":
        return (k - (bounds[i - 1] if i else 0)) * BLOCK_TOKENS
    return k * BLOCK_TOKENS


def page_cost(at: int, blocks: int) -> int:
    return (blocks - at) * BLOCK_TOKENS if PAGE_COST < 0 else PAGE_COST


def replay(requests: list[Request], capacity_units: float, policy: str, worth: bool, rule: str, state_units: int):
    """Reusable prompt tokens / prompt tokens, through a fresh Store."""
    page_value = bytes(UNIT)
    state_value = bytes(UNIT * state_units)
    store = Store(int(capacity_units) * UNIT, 0, "", eviction_policy=policy, warm_restart=False)
    seen: set[int] = set()
    reused = total = 0
    try:
        for req in requests:
            total += req.input_length
            chain = req.chain
            pages = [page_key(b) for b in chain]
            _, there = store.exists(pages[: req.hit_blocks_max]) if req.hit_blocks_max else ([], 0)
            hit = 0
            if there:
                flags, _ = store.exists([state_key(chain[k - 1]) for k in range(there, 0, -1)])
                hit = next((there - i for i, ok in enumerate(flags) if ok), 0)
            reused += hit * BLOCK_TOKENS
            full = pages[: req.full_blocks]
            if full:
                flags, _ = store.exists(full)
                missing = [i for i, ok in enumerate(flags) if not ok]
                if missing:
                    cost = [(int(ValueKind.ATTENTION_PAGE), page_cost(i, len(full))) for i in missing]
                    store.put_batch(
                        [full[i] for i in missing], [page_value] * len(missing), worth=cost if worth else None
                    )
            bounds = admitted_states(req, seen, rule)
            if bounds:
                keys = [state_key(chain[k - 1]) for k in bounds]
                flags, _ = store.exists(keys)
                todo = [(keys[i], k, state_cost(bounds, i)) for i, (ok, k) in enumerate(zip(flags, bounds)) if not ok]
                if todo:
                    cost = [(int(ValueKind.STATE_CHECKPOINT), c) for _, _, c in todo]
                    store.put_batch([t[0] for t in todo], [state_value] * len(todo), worth=cost if worth else None)
            seen.update(chain[: req.full_blocks])
    finally:
        store.close()
    return reused / max(1, total)


def one_round(requests: list[Request], fraction: float, state_units: int) -> dict[str, float]:
    capacity = fraction * working_set_units(requests, state_units)
    rates = {label: replay(requests, capacity, pol, w, rule, state_units) for label, pol, w, rule in NODE_RUNS}
    clair = {rule: simulate(requests, capacity, "clairvoyant", rule, state_units) for rule in ("every", "marconi")}
    rates["clairvoyant (better admission)"] = max(clair.values())
    rates["infinite (ceiling)"] = simulate(requests, capacity, "infinite", "every", state_units)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default="conversation,synthetic")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR, help="where NAME_trace.jsonl lie")
    parser.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    parser.add_argument("--fraction", type=float, default=0.1, help="memory / working set")
    parser.add_argument("--state-units", type=int, default=6, help="a state's size in pages")
    parser.add_argument("--windows", type=int, default=3, help="consecutive slices replayed on their own")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--page-cost", type=int, default=BLOCK_TOKENS, help="a page's cost in the worth runs")
    parser.add_argument("--state-cost", choices=("prefix", "marginal"), default="prefix")
    args = parser.parse_args(argv)
    global PAGE_COST, STATE_COST
    PAGE_COST, STATE_COST = args.page_cost, args.state_cost
    report: dict = {"load": os.getloadavg(), "traces": {}}
    for name in args.traces.split(","):
        requests = load_requests(args.trace_dir / f"{name}_trace.jsonl", args.limit)
        step = len(requests) // max(1, args.windows)
        rounds = [("whole", requests)] + [
            (f"window {w + 1}/{args.windows}", requests[w * step : (w + 1) * step]) for w in range(args.windows)
        ]
        rows = {}
        for label, part in rounds:
            rates = one_round(part, args.fraction, args.state_units)
            rows[label] = rates
            if not args.json:
                lru, best = rates["lru"] or 1e-12, rates["clairvoyant (better admission)"] or 1e-12
                print(f"{name} {label}: {len(part)} requests, load {os.getloadavg()[0]:.2f}", flush=True)
                for run, rate in rates.items():
                    print(f"  {run:32s} {rate:7.2%}  x{rate / lru:5.2f} of lru  {rate / best:5.2f} of clairvoyant")
        summary = {}
        for run in rows["whole"]:
            over_lru = [r[run] / (r["lru"] or 1e-12) for r in rows.values()]
            of_best = [r[run] / (r["clairvoyant (better admission)"] or 1e-12) for r in rows.values()]
            summary[run] = {
                "x_lru": (min(over_lru), statistics.median(over_lru), max(over_lru)),
                "of_clairvoyant": (min(of_best), statistics.median(of_best), max(of_best)),
            }
        report["traces"][name] = {"rounds": rows, "summary": summary}
        if not args.json:
            print(f"{name}: over {len(rows)} rounds, min/median/max")
            for run, s in summary.items():
                a, b = s["x_lru"], s["of_clairvoyant"]
                print(
                    f"  {run:32s} x lru {a[0]:.2f}/{a[1]:.2f}/{a[2]:.2f}  of clairvoyant {b[0]:.2f}/{b[1]:.2f}/{b[2]:.2f}"
                )
    report["load_after"] = os.getloadavg()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
