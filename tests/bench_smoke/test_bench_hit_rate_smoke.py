"""bench/hicache/hit_rate.py on tiny workloads: it runs through the real engine, prints what each
mode assumes, and its accounting is exact.

With room for every page and one request at a time nothing is evicted, so the SWA-unaware
baseline (SWA kept for every page) must hit exactly the longest cached whole-page prefix
of every prompt, computed here independently from the page-hash chain; the engine's
checkpoints can only hit less (ends and branch points only <= every C pages too <= that).
The trace file is written here (shared block prefixes), so no data outside the repo is read.
"""

from __future__ import annotations

import importlib
import json
from argparse import Namespace

import numpy as np

from gcache.wire.keys import page_hashes_array
from tests.support.tiny_model import ONE_FULL_LAYER, tiny_config

TINY = tiny_config(layer_pattern=ONE_FULL_LAYER)
BLOCK = 32  # tokens per trace block: 4 pages of 8
ARGS = Namespace(concurrency=1, chunk_tokens=64, lookahead=8, nodes_max=100_000)


def load_bench():
    return importlib.import_module("bench.hicache.hit_rate")


def write_trace(path, records: int, seed: int = 1):
    """Records whose block chains share prefixes (a few roots, random later blocks) and
    whose lengths end mid-block, in the Mooncake trace's format."""
    rng = np.random.default_rng(seed)
    chains, next_id = [[0, 1], [0, 2, 3], [4]], 5
    with open(path, "w") as f:
        for _ in range(records):
            base = list(chains[rng.integers(len(chains))])
            extra = list(range(next_id, next_id + int(rng.integers(1, 4))))
            next_id += len(extra)
            ids = base + extra
            chains.append(ids)
            length = (len(ids) - 1) * 512 + int(rng.integers(1, 513))
            f.write(json.dumps({"timestamp": 0, "input_length": length, "output_length": 1, "hash_ids": ids}) + "\n")
    return path


def ideal_hits(prompts, ps: int) -> int:
    """Longest whole-page prefix already cached (one token always left to compute)."""
    seen, total = set(), 0
    for p in prompts:
        keys = page_hashes_array(p[: len(p) // ps * ps], ps)
        n = 0
        while n < min(len(keys), (len(p) - 1) // ps) and keys[n] in seen:
            n += 1
        total += n * ps
        seen.update(keys)
    return total


def test_trace_hits_are_exact_without_eviction(tmp_path):
    bench = load_bench()
    from bench.common.workloads import trace_workload

    trace = write_trace(tmp_path / "trace.jsonl", 40)
    items = bench.trace_items(trace_workload(trace, 40, block_tokens=BLOCK, vocab=TINY.vocab_size))
    prompts = [it.prompt for it in items]
    pages = sum(len(p) // TINY.page_size + 2 for p in prompts)
    budget = 2 * pages * (bench.DualKVCache.page_bytes(TINY, "full") + bench.DualKVCache.page_bytes(TINY, "swa"))
    run = {m.name: bench.run_engine(m, items, TINY, budget, 1.0, ARGS) for m in bench.modes_for(BLOCK // 8)}
    base, tree, ends = run["baseline"], run["swa-tree"], run["swa-ends"]
    expected = ideal_hits(prompts, TINY.page_size)
    assert base.prompt_tokens == sum(len(p) for p in prompts)
    assert base.hit_tokens == expected > 0
    assert dict(base.by_tier) == {"l1": expected, "l2": 0, "l3": 0}
    assert base.dropped == base.preemptions == 0
    # Checkpoints every block hit what the branches share up to a block boundary; ends and
    # branch points alone used to miss a sibling's first branching off mid-chain, but with
    # room in the pools the SWA pages no checkpoint needs stay as spare pages (issue 19: the
    # first reuse hits), so nothing is evicted here and ends alone hit as much.
    assert 0 < ends.hit_tokens <= tree.hit_tokens <= base.hit_tokens
    again = bench.run_engine(bench.Mode("baseline", 1, True), items, TINY, budget, 1.0, ARGS)
    assert (again.hit_tokens, again.computed_tokens, again.steps) == (base.hit_tokens, base.computed_tokens, base.steps)


def test_chat_turns_hit_the_previous_turn_through_the_engine():
    bench = load_bench()
    from bench.common.workloads import chat_workload

    reqs = list(
        chat_workload(
            0,
            6,
            system_tokens=(100, 200),
            user_tokens=(10, 40),
            output_tokens=(10, 40),
            concurrency=3,
            vocab=TINY.vocab_size,
        )
    )
    items = bench.chat_items(reqs)
    linked = [it for it in items if it.prev is not None]
    assert len(linked) == len(reqs) - 6
    for it in linked:
        prev = reqs[it.prev]
        assert it.prev_len == len(prev.cached) and np.array_equal(it.prompt[: it.prev_len], prev.cached)
    budget = 4 * sum(len(r.cached) // 8 + 2 for r in reqs) * 12288
    args = Namespace(concurrency=2, chunk_tokens=64, lookahead=16, nodes_max=100_000)
    for mode in bench.modes_for(0):
        res = bench.run_engine(mode, items, TINY, budget, 1.0, args)
        # Each later turn hits at least what its previous turn cached: prompt + answer,
        # less the last answer token (never computed), in whole pages.
        floor = sum((it.prev_len - 1) // 8 * 8 for it in linked)
        assert floor <= res.hit_tokens <= res.prompt_tokens, mode
        assert res.dropped == 0 and dict(res.by_tier)["l2"] == dict(res.by_tier)["l3"] == 0


def test_main_prints_assumptions_and_working_set(tmp_path, capsys):
    bench = load_bench()
    trace = write_trace(tmp_path / "trace.jsonl", 12)
    bench.main(
        [
            "--conversations",
            "4",
            "--budget-mib",
            "16",
            "--chunk-tokens",
            "128",
            "--concurrency",
            "2",
            "--trace",
            str(trace),
            "--trace-requests",
            "12",
            "--trace-budget-mib",
            "256",
        ]
    )
    out = capsys.readouterr().out
    assert "measured through gcache.worker.engine.engine.Engine" in out
    assert out.count("working set:") == 2
    assert (
        "swa-tree  assumes: SWA KV only at checkpoints the engine makes (request ends, branch points; "
        "swa_checkpoint_pages=0)" in out
    )
    assert (
        "swa-tree  assumes: SWA KV only at checkpoints the engine makes (request ends, branch points, "
        "every 8 pages; swa_checkpoint_pages=8)" in out
    )
    assert (
        out.count(
            "baseline  assumes: SWA KV for every cached page (the same engine, swa_checkpoint_pages=1), equal pools"
        )
        == 2
    )
    assert out.count("ratio swa-tree / baseline hit rate:") == 2
    assert "ratio swa-ends / baseline hit rate:" in out
    summary = out.split("summary")[1].splitlines()
    assert summary[1].startswith("  chat ") and summary[2].startswith("  trace ")
