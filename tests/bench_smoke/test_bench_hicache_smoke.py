"""bench/hicache/hierarchy.py on tiny workloads: it prints its tables, and its accounting holds.

Runs main() once (chat + a trace file written here, 1 and 2 workers, every configuration,
real gcache-servers, the density measurement) with the unfitted cost model, and checks
exact properties of the figures: per-tier hits only from tiers a configuration has, the
SWA-unaware hierarchy writing SWA KV for every page to L3 (exactly (full + SWA) / page
size bytes per token), prefill tokens computed = prompt tokens - hits when nothing was
preempted. Plus the SGLang-style baseline tree's one rule, on a hand-built tree.
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import numpy as np
import pytest

from gcache.common.attention import AttentionKind
from gcache.worker.kvcache.kv_pool import DualKVCache, PagePool
from gcache.worker.kvcache.swa_tree.tree import SWARadixTree

pytestmark = pytest.mark.process  # starts processes


def load_bench():
    return importlib.import_module("bench.hicache.hierarchy")


def write_trace(path, records: int) -> None:
    """Mooncake-format records sharing a root block and some second blocks."""
    rng = np.random.default_rng(3)
    with open(path, "w") as f:
        for i in range(records):
            ids = [0, 1 + int(rng.integers(3))] + [100 + 10 * i + k for k in range(int(rng.integers(1, 4)))]
            f.write(
                json.dumps({"timestamp": i, "input_length": 512 * len(ids) - 100, "output_length": 40, "hash_ids": ids})
                + "\n"
            )


def test_hicache_bench_tables_and_accounting(tmp_path, capsys):
    bench = load_bench()
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, 10)
    png = tmp_path / "tiers.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []  # the bench extra
    out = bench.main(
        [
            *plot,
            "--cost",
            "default",
            "--seeds",
            "0",
            "--workers",
            "1,2",
            "--conversations",
            "4",
            "--answer-tokens",
            "8,24",
            "--trace",
            str(trace),
            "--trace-requests",
            "10",
            "--long-conversations",
            "1",
            "--jobs",
            "1",
            "--check-every",
            "1",
        ]
    )
    text = capsys.readouterr().out
    assert not plot or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = text.replace(" ".join(plot) + " ", "")
    assert text.startswith("command: .venv/bin/python -m bench.hicache.hierarchy --cost default")
    for line in (
        "=== chat",
        "=== trace",
        "configuration",
        "token hit",
        "TTFT P50",
        "L3 B/token",
        "cached prefix tokens held per KV byte",
        "=== targets",
        "gcache-server --memory",
    ):
        assert line in text, line
    setups = [s.name for s in bench.SETUPS]
    for name in setups:
        assert f"  {name} " in text, name
    runs = out["runs"]
    assert len(runs) == 2 * len(setups) * 2
    for (workload, seed, setup, workers), r in runs.items():
        info = out["info"][(workload, seed)]
        cfg = bench.model_for(workload, bench.parse_args([]))
        assert r.prompt_tokens == info["prompt_tokens"] and len(r.ttft_s) == info["requests"]
        assert all(t > 0 for t in r.ttft_s)
        hits = sum(r.hit_by_tier.values())
        assert 0 <= hits < r.prompt_tokens
        if r.preemptions == 0:
            assert r.recomputed == r.prompt_tokens - hits, (workload, setup, workers)
        if "L3" not in setup and setup != "SWA-unaware":
            assert r.hit_by_tier["l3"] == 0 and r.l3_full_pages == r.l3_swa_pages == 0
        if setup in ("L1", "SGLang-style L1"):
            assert r.hit_by_tier["l2"] == 0
        full_b, swa_b = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
        if setup == "SWA-unaware":
            assert r.l3_full_pages == r.l3_swa_pages > 0
            assert r.l3_bytes_per_token == (full_b + swa_b) / cfg.page_size
        if setup == "L1+L2+L3":
            assert 0 < r.l3_swa_pages < r.l3_full_pages
            assert r.l3_bytes_per_token < (full_b + swa_b) / cfg.page_size
    # One worker, no L2: the SGLang-style tree never hits more than ours on the same workload.
    for workload in ("chat", "trace"):
        assert runs[(workload, 0, "SGLang-style L1", 1)].hit <= runs[(workload, 0, "L1", 1)].hit
    upper = (full_b + swa_b) / full_b
    ratios = out["density"]["ratios"]
    assert set(ratios) == {"L1", "L2", "L3"} and all(1 < v <= upper for v in ratios.values())


def test_sglang_style_match_ends_only_at_node_boundaries():
    """One node of 8 pages whose SWA KV is live only on pages 2-3 (a checkpoint at page 4)
    and 6-7 (its end); W = 2 pages. A query leaving the node after page 6 has a tombstone
    (page 5) in that point's window: ours falls back to the mid-node checkpoint (16
    tokens), the SGLang-style tree to the last window-safe node boundary (the root)."""
    load_bench()
    from bench.hicache.sglang_tree import SGLangSWATree

    ps, window = 4, 8
    tokens = np.arange(8 * ps, dtype=np.int64)
    query = np.concatenate([tokens[: 6 * ps], np.full(ps + 1, 999, dtype=np.int64)])
    got = {}
    for cls in (SWARadixTree, SGLangSWATree):
        full, swa = PagePool(16, "full"), PagePool(16, "swa")
        tree = cls(ps, window, full, swa)
        live = swa.alloc(4)
        tree.insert(tokens, full.alloc(8), [None, None, live[0], live[1], None, None, live[2], live[3]])
        got[cls.__name__] = tree.match(query).prefix_len
        assert tree.match(np.concatenate([tokens, [999]])).prefix_len == 8 * ps  # the node end: both
        tree.check_integrity()
    assert got == {"SWARadixTree": 4 * ps, "SGLangSWATree": 0}
