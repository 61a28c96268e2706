"""bench/store/eviction_replay.py: the clairvoyant bound exactly on crafted traces, and a tiny run
of the replay against real servers (the full bench: bench/README.md)."""

import json
import random
from pathlib import Path

import pytest

from bench.store import eviction_replay
from bench.store.eviction_traces import Trace, clairvoyant_hit_rate, load_trace


def test_clairvoyant_hit_rate_is_exact_on_a_crafted_trace():
    trace = Trace("t", [[1, 2], [1, 2], [3], [1, 2]])  # 7 blocks
    assert clairvoyant_hit_rate(trace, 2) == pytest.approx(4 / 7)  # keeps 1, 2; never 3 (not used again)
    # One block of room: keeping 1 (next use sooner) beats keeping 2; 2 is never kept.
    assert clairvoyant_hit_rate(trace, 1) == pytest.approx(2 / 7)
    assert clairvoyant_hit_rate(trace, 0) == 0.0


def test_clairvoyant_keeps_a_chain_head_and_skips_blocks_never_used_again():
    trace = Trace("t", [[4, 5], [6], [4, 5]])
    # One block of room: 4 (needed before 5) is kept, 6 (never used again) is not.
    assert clairvoyant_hit_rate(trace, 1) == pytest.approx(1 / 5)


def test_load_trace_reads_mooncake_lines_and_refuses_others(tmp_path):
    good = tmp_path / "x_trace.jsonl"
    good.write_text('{"timestamp": 0, "hash_ids": [1, 2, 3]}\n\n{"timestamp": 1, "hash_ids": [1, 4]}\n')
    trace = load_trace(good)
    assert (trace.name, trace.chains, trace.blocks, trace.unique_blocks) == ("x", [[1, 2, 3], [1, 4]], 5, 4)
    assert load_trace(good, limit=1).chains == [[1, 2, 3]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "ids": [1]}\n')
    with pytest.raises(ValueError, match="hash_ids"):
        load_trace(bad)


def write_trace(path: Path, requests: int, seed: int = 3) -> None:
    """Documents with shared prefixes, re-read with a skew, each request one chain."""
    rng = random.Random(seed)
    docs, next_id, lines = [], 0, []
    for _ in range(requests):
        if docs and rng.random() < 0.6:
            doc = docs[min(int(rng.expovariate(0.3)), len(docs) - 1)]
        else:
            doc = list(range(next_id, next_id + rng.randrange(4, 24)))
            next_id += len(doc)
            docs.insert(0, doc)
        lines.append(json.dumps({"timestamp": 0, "hash_ids": doc}))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.process
def test_replay_runs_real_servers_and_reports_against_lru(tmp_path, capsys):
    trace_path = tmp_path / "tiny_trace.jsonl"
    write_trace(trace_path, 400)
    out = tmp_path / "runs.json"
    assert (
        eviction_replay.main(
            [
                "--traces",
                str(trace_path),
                "--fractions",
                "0.1",
                "--disk",
                "both",
                "--policies",
                "chain,lru",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "## tiny:" in printed and "vs lru" in printed and "clairvoyant" in printed
    runs = json.loads(out.read_text())
    assert sorted((r["policy"], r["disk"]) for r in runs) == [
        ("chain", False),
        ("chain", True),
        ("lru", False),
        ("lru", True),
    ]
    trace = load_trace(trace_path)
    capacity = eviction_replay.memory_bytes(trace, 0.1, 4096) // 4096  # the 1 MiB floor: 256 blocks
    for r in runs:
        assert r["exists_then_missed"] == 0
        bound = clairvoyant_hit_rate(trace, capacity * (2 if r["disk"] else 1))
        assert 0 < r["hit_rate"] <= bound + 1e-9
        assert r["counters"]["puts_stored"] > 0
    lru_line = next(line for line in printed.splitlines() if " lru " in line and " off " in line)
    assert " 1.000 " in lru_line


@pytest.mark.process
def test_replay_plot_draws_hit_rate_per_policy(tmp_path):
    pytest.importorskip("matplotlib")
    trace_path = tmp_path / "tiny_trace.jsonl"
    write_trace(trace_path, 200)
    png = tmp_path / "replay.png"
    args = ["--traces", str(trace_path), "--fractions", "0.1", "0.5", "--disk", "off", "--policies", "lru"]
    assert eviction_replay.main([*args, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
