"""bench/pd, tiny: every request is served once in each mode, host pre-allocation holds no
device page, device pre-allocation does, a rerun repeats exactly, and the script runs."""

from __future__ import annotations

from bench.pd import disagg
from bench.pd.sim import Setup, run, workload
from gcache.worker.config import ModelConfig
from gcache.worker.model.sim import CostModel


def test_tiny_runs_add_up_and_repeat_exactly():
    cfg = ModelConfig(dtype="float32")
    jobs = workload(10, 2.0, seed=1, long_share=0.3, long_range=(1024, 2048))
    setup = Setup(full_pages=1024, swa_pages=256, l2_bytes=64 << 20, link_gbs=1.0, pd_min_prompt_tokens=512)
    out = {m: run(cfg, jobs, setup, CostModel(), m) for m in disagg.MODES}
    for m, r in out.items():
        assert len(r.ttft_s) == len(jobs) and len(r.tpot_s) == len(jobs), m
        assert min(r.ttft_s) > 0 and r.makespan_s > max(j.arrival_s for j in jobs)
    longs = sum(j.long for j in jobs)
    assert longs and out["pd_host"].held_peak == 0 and out["pd_device"].held_peak > 0
    assert out["pd_host"].handoff_bytes == out["pd_device"].handoff_bytes > 0
    again = run(cfg, jobs, setup, CostModel(), "pd_host")
    assert again.ttft_s == out["pd_host"].ttft_s and again.tpot_s == out["pd_host"].tpot_s


def test_the_script_runs(capsys):
    assert disagg.main(["--quick", "--cost", "default"]) == 0
    printed = capsys.readouterr().out
    assert "TPOT P90 mixed/PD" in printed and "Device KV held by handoffs" in printed
