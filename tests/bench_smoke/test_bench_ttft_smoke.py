"""bench/worker/ttft.py, tiny: the figures add up, both policies see one workload, runs repeat exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.worker import ttft, ttft_cost
from gcache.worker.config import ModelConfig

TINY = ["--cost", "default", "--requests", "30", "--seeds", "0,1", "--rates", "20"]


def test_tiny_sweep_adds_up_and_repeats_exactly(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    result = ttft.main(TINY + ["--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("command: .venv/bin/python -m bench.worker.ttft " + " ".join(TINY))
    assert "working set, seed 0: 30 requests" in printed and "rates: --rates 20" in printed
    (point,) = result["sweep"]
    assert point["rate"] == 20.0 and point["load"] is None
    for policy in ttft.POLICIES:
        runs = point["runs"][policy]
        assert [r["policy"] for r in runs] == [policy] * 2
        assert all(r["n_long"] + r["n_short"] == 30 for r in runs)
        assert all(0 < r["busy"] <= 1 and r["long_p50"] <= r["long_p90"] for r in runs)
    for m in ttft.METRICS:
        expect = [(t[m] - f[m]) / f[m] * 100 for f, t in zip(point["runs"]["fcfs"], point["runs"]["ttft"])]
        assert point["change"][m] == expect
    # Same prompts for both policies: the long/short split is the workload's, not the run's.
    assert [r["n_long"] for r in point["runs"]["fcfs"]] == [r["n_long"] for r in point["runs"]["ttft"]]
    assert [r["policy"] for r in result["floor"]] == ["fcfs", "fcfs"]
    saved = json.loads(out.read_text())
    assert saved["sweep"][0]["change"] == point["change"]
    again = ttft.main(TINY)  # virtual clock: every figure repeats exactly
    assert again["sweep"][0]["runs"] == point["runs"] and again["floor"] == result["floor"]


@pytest.mark.process  # matplotlib may run fc-list for its font cache
def test_plot_draws_the_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "ttft.png"
    ttft.main(["--cost", "default", "--requests", "20", "--seeds", "0", "--rates", "10,20", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workload_prompts_do_not_depend_on_the_rate():
    args = ttft.parse_args(["--requests", "40"])
    slow, fast, burst = (ttft.make_workload(args, 3, rate) for rate in (1.0, 9.0, None))
    assert [w.prompt for w in slow] == [w.prompt for w in fast] == [w.prompt for w in burst]
    assert [w.t * 1.0 for w in slow] == pytest.approx([w.t * 9.0 for w in fast])
    assert all(w.t == 0.0 for w in burst)
    assert [w.t for w in slow] == sorted(w.t for w in slow)
    docs = {}
    for w in slow:
        assert (w.kind == "doc_qa") == (w.doc >= 0) and (w.doc_len > 0) == (w.doc >= 0)
        if w.doc >= 0:  # every question on a document starts with that same document
            assert docs.setdefault(w.doc, w.prompt[: w.doc_len]) == w.prompt[: w.doc_len]
    assert docs and len(slow) == 40


def test_fitted_clock_is_read_from_the_calibration_file(tmp_path, capsys):
    cost = {"base_s": 0.003, "token_s": 0.0002, "req_s": 0.0005, "kv_s": 6e-07, "read_s": 7e-07, "swa_dense": True}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"cost": cost, "median_rel_error": 0.04, "fitted_at": "then"}))
    result = ttft.main(["--cal-file", str(cal), "--requests", "20", "--seeds", "0", "--rates", "2"])
    assert result["cost"] == cost  # read, not refitted (a fit here would give other numbers)
    assert f"fit read from {cal}" in capsys.readouterr().out


@pytest.mark.slow
def test_real_model_mode_runs_on_the_fitted_clock(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(
        json.dumps(
            {
                "cost": {
                    "base_s": 0.004,
                    "token_s": 0.0002,
                    "req_s": 0.0005,
                    "kv_s": 6e-07,
                    "read_s": 6e-07,
                    "swa_dense": True,
                },
                "median_rel_error": 0.05,
            }
        )
    )
    result = ttft.main(
        [
            "--mode",
            "real",
            "--cal-file",
            str(cal),
            "--requests",
            "6",
            "--scale",
            "0.05",
            "--seeds",
            "0",
            "--rates",
            "5",
            "--hot-docs",
            "2",
        ]
    )
    run = result["sweep"][0]["runs"]["ttft"][0]
    assert run["real_wall_s"] > 0 and run["fitted_s"] > 0


def test_nnls_relative_fits_exact_costs_and_never_goes_negative():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(40), rng.uniform(1, 500, 40), rng.integers(1, 33, 40), rng.uniform(1e3, 1e6, 40)])
    c = np.array([0.004, 2e-4, 5e-4, 1e-9])
    np.testing.assert_allclose(ttft_cost.nnls_relative(X, X @ c), c, rtol=1e-8)
    y = X @ np.array([0.004, 2e-4, -1e-4, 1e-9])  # a negative per-sequence cost: not a cost model
    assert (y > 0).all()
    fit = ttft_cost.nnls_relative(X, y)
    assert (fit >= 0).all() and fit[2] == 0.0


def test_calibration_cache_path_is_per_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = ModelConfig(dtype="float32")
    a, b = ttft_cost.default_cache_path(cfg, 5), ttft_cost.default_cache_path(cfg, 3)
    assert a.startswith(str(tmp_path / "gcache")) and a != b
    assert a == ttft_cost.default_cache_path(ModelConfig(dtype="float32"), 5)
