"""bench/router/policies.py on tiny workloads: it prints its tables, its accounting holds exactly, runs
are deterministic, and the SWA mis-routing case comes out as designed.

main() runs once (--quick: chat + a trace file written here, 2 workers, every policy, the real
RouterCore and WorkerPublisher over a real redis-server, the unfitted cost model and a fixed
host -> device copy rate), then once more for one policy to check that a rerun gives the same
figures.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

pytestmark = pytest.mark.process  # starts processes

POLICIES = ("round_robin", "least_load", "approx_tree", "dynamo", "cache_aware", "cache_ttft")


def load_bench():
    return importlib.import_module("bench.router.policies")


def write_trace(path, records: int) -> None:
    """Mooncake-format records: a shared root block, and every third record the next turn of
    the record two before it (its complete blocks, then a new one)."""
    rng = np.random.default_rng(5)
    recs = []
    for i in range(records):
        if i % 3 == 2:
            prev = recs[i - 2]["hash_ids"]
            ids = prev + [5000 + i]
        else:
            ids = [0] + [100 + 10 * i + k for k in range(int(rng.integers(2, 4)))]
        recs.append({"timestamp": i, "input_length": 512 * len(ids) - 100, "output_length": 40, "hash_ids": ids})
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_trace_slice_links_turns_by_complete_blocks(tmp_path):
    load_bench()
    from bench.router.workloads import trace_slice

    path = tmp_path / "t.jsonl"
    recs = [
        {"input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 2]},  # complete: [0, 1]
        {"input_length": 1000, "output_length": 8, "hash_ids": [0, 7]},  # complete: [0] (< 2)
        {"input_length": 2000, "output_length": 8, "hash_ids": [0, 1, 3, 4]},  # extends record 0
        {"input_length": 700, "output_length": 8, "hash_ids": [0, 7, 8]},  # record 1 too short
        {"input_length": 2600, "output_length": 8, "hash_ids": [0, 1, 3, 4, 9, 10]},
    ]  # extends 2
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    turns = trace_slice(path, 0, 10, block_tokens=64, prompt_tokens_max=4096, output_tokens_max=16)
    assert [t.after for t in turns] == [-1, -1, 0, -1, 2]
    assert [len(t.prompt) for t in turns] == [187, 125, 250, 87, 325]
    assert [t.max_tokens for t in turns] == [1, 1, 1, 1, 1]
    assert np.array_equal(turns[2].prompt[:128], turns[0].prompt[:128])  # two shared blocks
    assert np.array_equal(turns[4].prompt[:250], turns[2].prompt)  # a turn extends its predecessor
    tail = trace_slice(path, 2, 10, block_tokens=64, prompt_tokens_max=4096, output_tokens_max=16)
    assert [t.after for t in tail] == [-1, -1, 0]  # the offset window links only inside itself


def test_router_bench_quick(tmp_path, capsys):
    bench = load_bench()
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, 24)
    common = ["--quick", "--cost", "default", "--jobs", "1", "--trace", str(trace), "--h2d-gbps", "5"]
    out = bench.main(common)
    text = capsys.readouterr().out
    assert text.startswith("command: .venv/bin/python -m bench.router.policies --quick --cost default")
    for line in (
        "=== chat",
        "=== trace",
        "chat, 2 workers, load x1",
        "trace, 2 workers, load x1",
        "token hit",
        "TTFT P90",
        "imbalance",
        "=== SWA mis-routing case",
        "=== targets",
        "hit/LL",
    ):
        assert line in text, line
    for p in POLICIES:
        assert text.count(f"\n  {p} ") >= 3, p  # both workloads and the SWA case
    runs = out["runs"]
    assert set(runs) == {(w, 0, p, 2, 1.0) for w in ("chat", "trace") for p in POLICIES}
    for (workload, seed, policy, workers, scale), r in runs.items():
        info = out["info"][(workload, seed, workers)]
        assert r.requests == info["requests"] and r.prompt_tokens == info["prompt_tokens"], (workload, policy)
        assert len(r.ttft_s) == r.requests and all(t > 0 for t in r.ttft_s)
        assert sum(r.served) == r.requests and len(r.served) == workers == len(r.busy_s)
        hits = sum(r.hit_by_tier.values())
        assert 0 <= hits < r.prompt_tokens and r.hit_by_tier["l3"] == 0  # no --l3
        if r.preemptions == 0:
            # Every prompt token not counted as a hit is computed once, except that a hit is
            # counted at first admission (usage.cached_tokens) and a request the engine sends
            # back to the queue when the pools fill may match more when it is admitted again.
            assert r.prompt_tokens - hits - r.prompt_tokens // 50 <= r.recomputed <= r.prompt_tokens - hits
        assert r.imbalance >= 1.0 and r.work_imbalance >= 1.0
        assert 0 <= r.misroutes <= r.swa_lost_routes and r.misroute_tokens >= 0
        if policy == "round_robin":  # one router over two workers: they alternate
            assert sorted(r.served) == [r.requests // 2, r.requests - r.requests // 2]
    assert runs[("trace", 0, "least_load", 2, 1.0)].requests == 24
    # The chat is multi-turn: keeping a conversation on its worker must beat spreading it.
    assert runs[("chat", 0, "cache_aware", 2, 1.0)].hit > runs[("chat", 0, "round_robin", 2, 1.0)].hit

    case = out["swa_case"]
    assert case["held"] == [(0, 1120), (1024, 1024)]  # A: full KV but no window-safe point; B: D
    picked = {row["policy"]: (row["picked"], row["cached"]) for row in case["rows"]}
    assert picked["approx_tree"] == ("A", 0) and picked["dynamo"] == ("A", 0)
    assert picked["cache_aware"] == ("B", 1024) and picked["cache_ttft"] == ("B", 1024)
    assert case["met"] is True
    by = {row["policy"]: row for row in case["rows"]}
    assert by["cache_aware"]["ttft_s"] < by["dynamo"]["ttft_s"]

    # Deterministic: the same run again gives the same figures, request by request (this time
    # with a second load point: the same requests at twice the rate).
    again = bench.main(
        common
        + [
            "--workloads",
            "chat",
            "--policies",
            "cache_aware",
            "--no-swa-case",
            "--load-scales",
            "1,2",
            "--sweep-seeds",
            "0",
        ]
    )
    assert "chat, 2 workers, load x2" in capsys.readouterr().out
    assert set(again["runs"]) == {("chat", 0, "cache_aware", 2, 1.0), ("chat", 0, "cache_aware", 2, 2.0)}
    double = again["runs"][("chat", 0, "cache_aware", 2, 2.0)]
    again = again["runs"][("chat", 0, "cache_aware", 2, 1.0)]
    assert double.requests == again.requests and double.mean_load > again.mean_load
    first = runs[("chat", 0, "cache_aware", 2, 1.0)]
    assert again.hit_by_tier == first.hit_by_tier and again.served == first.served
    assert again.ttft_s == first.ttft_s and again.imbalance == first.imbalance
