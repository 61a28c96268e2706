"""Smoke run of bench/sglang/backend.py on tiny pages: it runs end to end and prints its table."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.process  # starts processes


def test_sglang_backend_bench_smoke(tmp_path, capsys):
    bench = importlib.import_module("bench.sglang.backend")
    assert (
        bench.main(
            [
                "--repeats",
                "2",
                "--pages",
                "4",
                "--page-size",
                "4",
                "--layers",
                "2",
                "--heads",
                "2",
                "--head-dim",
                "8",
                "--server-memory",
                "64MiB",
                "--work-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "working set: 4 pages x 512 B = 0.0 MiB per batch (page_first" in out
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith(("set ", "get "))]
    assert rows == [[op, system] for op in ("set", "get") for system in ("raw", "GCache", "SGLang")]
    assert out.count("backend overhead on ") == 2
    assert "backend's own work per batch (medians): keys + pointers " in out
