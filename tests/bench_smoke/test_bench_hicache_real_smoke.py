"""Smoke runs of bench/hicache/real.py and bench/hicache/layerwise_load.py on a tiny model.

Only that they run end to end and print their tables, with the exact tier splits the
workloads force (no timing assertions): B reads the prompt's whole pages from L3 before and
after its restart, and so does D (the identical prompt; 67 tokens, so its last whole page is
before its last token), A' hits them in L1, C (no prefix cache) and A (cold) hit nothing. layerwise_load
itself raises unless every timed request is an L2 hit of the whole prefix.
"""

from __future__ import annotations

import importlib
import json
import os

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


from tests.support.tiny_model import ONE_FULL_LAYER, TINY_MODEL  # noqa: E402

pytestmark = pytest.mark.process  # starts gcache processes

TINY = {**TINY_MODEL, "layer_pattern": list(ONE_FULL_LAYER)}


def load_bench(name: str):
    return importlib.import_module(f"bench.hicache.{name}")


def test_hicache_real_smoke(tmp_path, capsys):
    bench = load_bench("real")
    assert (
        bench.main(
            [
                "--runs",
                "1",
                "--prompt-tokens",
                "67",
                "--config-json",
                json.dumps(TINY),
                "--l2-mib",
                "4",
                "--server-memory",
                "64MiB",
                "--work-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = {line.split("   ")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    assert rows["L3 hit on a second worker (B)"].endswith("l1=0 l2=0 l3=64")
    assert rows["L3 hit after restarting B (B')"].endswith("l1=0 l2=0 l3=64")
    assert rows["L1 hit on A (floor) (A')"].endswith("l1=64 l2=0 l3=0")
    assert rows["compute it: no prefix cache (C)"].endswith("l1=0 l2=0 l3=0")
    assert rows["compute it: cold, writes L2/L3 (A)"].endswith("l1=0 l2=0 l3=0")
    assert rows["identical P on a third worker (D)"].endswith("l1=0 l2=0 l3=64")  # 67 tokens: 8 whole pages
    for label in ("B  / C (TTFT)", "B' / A (wall)"):
        assert any(line.strip().startswith(label) for line in out.splitlines()), label
    assert "target: B's TTFT <= 0.25x of computing it" in out
    assert "missed part of P" not in out


def test_layerwise_load_smoke(capsys):
    bench = load_bench("layerwise_load")
    assert (
        bench.main(
            [
                "--repeats",
                "2",
                "--cal-repeats",
                "1",
                "--prefix-tokens",
                "96",
                "--suffix-tokens",
                "8",
                "--config-json",
                json.dumps(TINY),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("  repeat ") == 2
    for label in (
        "TTFT, load everything then compute (serial)",
        "TTFT, layer-wise load overlapped",
        "T_load (serial copy time",
        "load time hidden = (T_serial - T_layerwise) / T_load",
        "target: >= 70% of load time hidden",
    ):
        assert label in out, label
