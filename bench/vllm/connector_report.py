"""The tables of bench/vllm/connectors.py (markdown, so docs/vllm-connectors.md can quote them):
TTFT P50 / P90 per cell and arm as median [min..max] over rounds, GCache's ratios taken within
each round, hit tokens, outputs differing from the no-connector run, throughput."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common.stats import median_range

PEERS = ("example", "mooncake", "lmcache")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _s(x: float) -> str:
    return f"{x:.3f}"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def _runs(rounds: list[dict], arm: str, cell: str) -> list[Any]:
    """Per round: the list of hit runs, or an error string, or None (not run)."""
    out = []
    for r in rounds:
        v = r.get(arm, {}).get(cell)
        out.append(v.get("error") if isinstance(v, dict) else v)
    return out


def _cells(rounds: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rounds:
        for arm in r.values():
            for cell in arm:
                if not cell.startswith("_") and cell != "throughput":
                    seen[cell] = None
    return list(seen)


def _quantiles(runs: list[Any], q: float) -> list[float]:
    return [percentile([x["ttft"] for x in r], q) for r in runs if isinstance(r, list) and r]


def _error(runs: list[Any]) -> str:
    return next((r for r in runs if isinstance(r, str)), "")


def ttft_tables(rounds: list[dict], arms: list[str]) -> list[str]:
    cells = _cells(rounds)
    lines = ["| cell | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    errors: dict[str, str] = {}
    for cell in cells:
        for label, q in (("P50", 0.5), ("P90", 0.9)):
            row = []
            for arm in arms:
                runs = _runs(rounds, arm, cell)
                vals = _quantiles(runs, q)
                if vals:
                    row.append(median_range(vals, _s))
                else:
                    row.append("failed" if _error(runs) else "-")
                    if _error(runs):
                        errors[f"{arm} / {cell}"] = _error(runs)
            lines.append(f"| {cell} TTFT {label} (s) | " + " | ".join(row) + " |")
        hits, wrong = [], []
        ref = _reference(rounds, cell)
        for arm in arms:
            runs = [r for r in _runs(rounds, arm, cell) if isinstance(r, list)]
            flat = [x for r in runs for x in r]
            hits.append(str(int(statistics.median([x["cached"] for x in flat]))) if flat else "-")
            wrong.append(f"{sum(x['tokens'] != ref for x in flat)}/{len(flat)}" if flat and ref is not None else "-")
        lines.append(f"| {cell} hit tokens (median) | " + " | ".join(hits) + " |")
        lines.append(f"| {cell} outputs != recompute | " + " | ".join(wrong) + " |")
    lines += ["", "GCache's TTFT / the other arm's, per round (median [min..max]; < 1: GCache faster):", ""]
    others = [a for a in arms if a != "gcache"]
    lines += ["| cell | " + " | ".join(f"P50 vs {a}" for a in others) + " | P50 vs best peer | P90 vs best peer |"]
    lines += ["|---" * (len(others) + 3) + "|"]
    for cell in cells:
        row = [_ratio(rounds, cell, [a], 0.5) for a in others]
        peers = [a for a in arms if a in PEERS]
        row += [_ratio(rounds, cell, peers, 0.5), _ratio(rounds, cell, peers, 0.9)]
        lines.append(f"| {cell} | " + " | ".join(row) + " |")
    if errors:
        lines += ["", "Failed cells:"] + [f"- {k}: {v}" for k, v in errors.items()]
    return lines


def _reference(rounds: list[dict], cell: str) -> list[int] | None:
    for r in rounds:
        runs = r.get("recompute", {}).get(cell)
        if isinstance(runs, list) and runs:
            tokens: list[int] = runs[0]["tokens"]
            return tokens
    return None


def _ratio(rounds: list[dict], cell: str, versus: list[str], q: float) -> str:
    """GCache's quantile / the best (lowest) of `versus` in the same round."""
    ratios = []
    for r in rounds:
        g = r.get("gcache", {}).get(cell)
        others = [r.get(a, {}).get(cell) for a in versus]
        best = [percentile([x["ttft"] for x in o], q) for o in others if isinstance(o, list) and o]
        if isinstance(g, list) and g and best:
            ratios.append(percentile([x["ttft"] for x in g], q) / min(best))
    return median_range(ratios, _x) if ratios else "-"


def throughput_table(rounds: list[dict], arms: list[str]) -> list[str]:
    ref: dict[str, Any] = next(
        (
            r["recompute"]["throughput"]["results"]
            for r in rounds
            if "results" in r.get("recompute", {}).get("throughput", {})
        ),
        {},
    )
    lines = [
        "| arm | output tokens/s | cached tokens (of prompt tokens) | outputs != recompute | GCache tok/s / arm's |",
        "|---|---|---|---|---|",
    ]
    errors = {}
    for arm in arms:
        tps, cached, wrong, ratios = [], [], [], []
        prompt = 0
        for r in rounds:
            t = r.get(arm, {}).get("throughput")
            if not isinstance(t, dict):
                continue
            if "error" in t:
                errors[arm] = t["error"]
                continue
            res = t["results"]
            out_tokens = sum(len(x["tokens"]) for x in res.values())
            tps.append(out_tokens / t["wall_s"])
            cached.append(sum(x["cached"] for x in res.values()))
            prompt = sum(x["prompt"] for x in res.values())
            wrong.append(sum(1 for k, x in res.items() if k in ref and x["tokens"] != ref[k]["tokens"]))
            g = r.get("gcache", {}).get("throughput", {})
            if "results" in g:
                g_tps = sum(len(x["tokens"]) for x in g["results"].values()) / g["wall_s"]
                ratios.append(g_tps / tps[-1])
        if not tps:
            lines.append(f"| {arm} | failed | - | - | - |" if arm in errors else f"| {arm} | - | - | - | - |")
            continue
        lines.append(
            f"| {arm} | {median_range(tps, lambda x: f'{x:.1f}')} | {int(statistics.median(cached))} ({prompt}) "
            f"| {max(wrong)}/{len(ref)} | {median_range(ratios, _x) if ratios else '-'} |"
        )
    if errors:
        lines += ["", "Failed:"] + [f"- {k}: {v}" for k, v in errors.items()]
    return lines


def report(results: dict[str, Any], arms: list[str], args: argparse.Namespace) -> str:
    m = results["models"]
    d = m["dims"]
    loads = [x[0] for x in results["load"]]
    rounds = results["rounds"]
    lines = [
        f"vLLM connectors side by side: {args.rounds} rounds x {args.repeats} hits per cell, arms {', '.join(arms)}",
        f"model: Llama-style, {d['layers']} layers, hidden {d['hidden_size']}, {d['num_attention_heads']} heads / "
        f"{d['num_key_value_heads']} KV heads x {d['head_dim']}, {d['params'] / 1e6:.1f}M params, fp32, block 32, "
        f"{m['kv_bytes_per_token']} KV bytes per token; hybrid: Gemma2-style 4 layers (window 32 / full)",
        f"busy = {args.busy} other requests decoding in B; 1-minute load during the run: "
        f"{min(loads):.1f} .. {statistics.median(loads):.1f} .. {max(loads):.1f} (2-core machine, shared)",
        "",
    ]
    lines += ttft_tables(rounds, arms)
    if args.tp_requests:
        tp = next((r[a]["throughput"] for r in rounds for a in r if "ws_bytes" in r[a].get("throughput", {})), None)
        lines += [
            "",
            f"Throughput: 2 engines, {args.tp_requests} trace turns, a conversation's next turn on the other engine",
        ]
        if tp:
            lines[-1] += f"; replay KV {tp['ws_bytes'] / 2**20:.0f} MiB, stores {tp['store_bytes'] / 2**20:.0f} MiB"
        lines += [""] + throughput_table(rounds, arms)
    if results["skipped"]:
        lines += ["", "Not run here:"] + [f"- {k}: {v}" for k, v in results["skipped"].items()]
    return "\n".join(lines)
