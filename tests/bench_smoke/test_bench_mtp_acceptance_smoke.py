"""bench/worker/mtp_acceptance.py on one short prompt: a real gcache-server as L3, every
mode's greedy output checked equal to decoding without MTP, the tiers mode's MTP tail from
L3 with nothing rebuilt (the bench asserts those itself), and every mode and bucket printed."""

from __future__ import annotations

import pytest

from bench.worker import mtp_acceptance


@pytest.mark.process
def test_the_mtp_acceptance_bench_runs_every_mode(capsys):
    mtp_acceptance.main(["--prompts", "1", "--tokens", "40", "--prompt-bytes", "300"])
    out = capsys.readouterr().out
    pooled = out.split("pooled over the prompts")[1]
    for mode in mtp_acceptance.MODES:
        assert f"  {mode} " in pooled, mode
    assert "mtp pool: " in out and "checkpoint tails" in out
