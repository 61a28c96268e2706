"""Smoke run of bench/sglang/embedding.py on a tiny item: it runs end to end and prints its table."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.process  # starts processes


def test_sglang_embedding_bench_smoke(capsys):
    bench = importlib.import_module("bench.sglang.embedding")
    argv = ["--repeats", "3", "--tokens", "40", "--dim", "64", "--dtype", "float32", "--server-memory", "64MiB"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "item: 40 x 64 float32 = 0.01 MB; transport " in out
    rows = [line[:22].strip() for line in out.splitlines()[3:] if not line.startswith("reader")]
    assert rows == list(bench.ROWS)
    assert "reader counters: bytes_staged=0 items_read=8" in out
