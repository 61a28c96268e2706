"""bench/router/tiers.py (the tier simulator over the real router policies) on a tiny trace: its
accounting holds exactly, it is deterministic, the connector decides who loads from the L3, and
the tier-aware score credits the L3 only on engines that can load it. Also the pieces
bench/router/vllm_trace.py is built from that run without vLLM: the trace's conversations as
text prompts, and the reading of vLLM's Prometheus counters.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.router import tier_sim, tiers
from bench.router.tier_sim import PageLRU, SimEngine, TierCosts, TierSpec, candidates, simulate
from gcache.router.config import RouterConfig
from gcache.router.policies import Prompt, make_policy


def write_trace(path, records: int) -> None:
    """Mooncake-format records: a shared root block; every third record the next turn of the
    record two before it (its complete blocks, then a new one)."""
    rng = np.random.default_rng(5)
    recs: list[dict] = []
    for i in range(records):
        if i % 3 == 2:
            ids = recs[i - 2]["hash_ids"] + [5000 + i]
        else:
            ids = [0] + [100 + 10 * i + k for k in range(int(rng.integers(2, 5)))]
        recs.append({"timestamp": i, "input_length": 512 * len(ids) - 100, "output_length": 40, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, 60)
    return path


def test_tiers_cli_accounts_for_every_token_and_reruns_the_same(trace, capsys):
    argv = ["--trace", str(trace), "--slices", "2", "--requests", "30", "--stride", "30", "--engines", "2"]
    argv += ["--loads", "0.5,1.5", "--l1-frac", "0.2", "--block-tokens", "64"]
    out = tiers.main(argv)
    text = capsys.readouterr().out
    assert text.startswith("command: .venv/bin/python -m bench.router.tiers --trace")
    for line in ("[all: connector on every engine; load 0.5]", "[half: connector on half the engines; load 1.5]"):
        assert line in text
    for p in ("round_robin", "least_load", "report", "tier_aware"):
        assert text.count(f"\n{p} ") == 4, p  # 2 scenarios x 2 loads
    assert len(out["runs"]) == 2 * 2 * 2 * 4
    for (s, scen, load, p), r in out["runs"].items():
        info = out["slices"][s]
        assert r.requests == info["requests"] == 30 and len(r.ttft_s) == 30 and min(r.ttft_s) > 0
        assert r.l1_tokens + r.l3_tokens + r.recomputed == r.prompt_tokens, (s, scen, load, p)
        assert r.prefill_cost == pytest.approx(r.recomputed + 0.1 * r.l3_tokens)
        assert sum(r.served) == 30
        if p == "round_robin":  # one router, two engines: they alternate
            assert sorted(r.served) == [15, 15]
    # multi-turn: some follow-up turns hit (the shared root block alone is less than a page here)
    assert out["runs"][(0, "all", 0.5, "report")].hit > 0
    again = tiers.main(argv)
    for key, r in out["runs"].items():
        assert again["runs"][key].ttft_s == r.ttft_s and again["runs"][key].served == r.served, key


def _turns(path, page_size=16):
    from bench.router.workloads import trace_slice

    return tier_sim.sim_turns(trace_slice(path, 0, 60, 64, 4096, 16), page_size)


def test_only_engines_with_the_connector_load_from_the_l3(trace):
    turns = _turns(trace)
    ws = tier_sim.working_set_pages(turns)
    arrivals = np.arange(len(turns), dtype=float) * 0.01
    knobs = tier_sim.policy_knobs(0.5)
    for connectors in ((False, False), (True, False), (True, True)):
        spec = TierSpec(2, connectors, max(ws // 8, 20), ws * 2, 16, TierCosts())
        r = simulate(turns, spec, "round_robin", knobs["round_robin"], arrivals)
        assert (r.l3_tokens > 0) == any(connectors), connectors
    # with L3 weight 0 the tier-aware score is the report's: the same run, request by request
    spec = TierSpec(2, (True, False), max(ws // 8, 20), ws * 2, 16, TierCosts())
    a = simulate(turns, spec, "report", knobs["report"], arrivals)
    b = simulate(turns, spec, "tier_aware", tier_sim.policy_knobs(0.0)["tier_aware"], arrivals)
    assert a.ttft_s == b.ttft_s and a.served == b.served


def test_tier_aware_credits_the_l3_only_where_it_can_be_loaded():
    spec = TierSpec(2, (False, True), 64, 64, 16)
    engines = [SimEngine(k, spec) for k in range(2)]
    ids = tuple(range(1000, 1010))  # a 10-page prompt the shared L3 holds, no engine's L1
    l3 = PageLRU(64, tier_sim.L3_FULL)
    l3.put(ids)
    prompt = Prompt(10 * 16 + 1, lambda _ps: ids, l3.flags, 16)
    scores = {}
    for name, knobs in tier_sim.policy_knobs(0.5).items():
        if name in ("report", "tier_aware"):
            cfg = RouterConfig(redis_url=tier_sim.UNUSED_REDIS, recent_ttl_s=0.0, page_size=16, **knobs)
            _, s = make_policy(cfg).evaluate(prompt, candidates(engines, ids, 16))
            scores[name] = [s[e.url]["score"] for e in engines]
    assert scores["report"][0] == scores["report"][1]  # the L3 is worth nothing to the report's formula
    assert scores["tier_aware"][1] > scores["tier_aware"][0]  # engine 1 has the connector
    assert scores["tier_aware"][0] == scores["report"][0]


def test_page_lru_evicts_a_prompts_suffix_first():
    lru = PageLRU(4, 1)
    lru.put([1, 2, 3])
    lru.put([7, 8])  # 5 pages in a 4-page cache: the oldest suffix page (3) goes
    assert list(lru.flags) == [2, 1, 8, 7] and lru.run([1, 2, 3], 0, 3) == 2


def test_trace_conversations_as_text_share_their_prefixes(tmp_path):
    from bench.router.trace_chats import block_text, conversations, prompt_text

    path = tmp_path / "t.jsonl"
    recs = [
        {"input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 2]},
        {"input_length": 900, "output_length": 8, "hash_ids": [0, 5]},  # one turn only: left out
        {"input_length": 2000, "output_length": 8, "hash_ids": [0, 1, 3, 4]},  # record 0's next turn
        {"input_length": 1500, "output_length": 8, "hash_ids": [0, 6, 7]},
        {"input_length": 2100, "output_length": 8, "hash_ids": [0, 6, 7, 8, 9]},  # record 3's
        {"input_length": 2600, "output_length": 8, "hash_ids": [0, 1, 3, 4, 10]},  # record 2's
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs = conversations(path, requests=10)
    assert [c.first_record for c in convs] == [0, 3]
    assert [[t.blocks for t in c.turns] for c in convs] == [
        [(0, 1, 2), (0, 1, 3, 4), (0, 1, 3, 4, 10)],
        [(0, 6, 7), (0, 6, 7, 8, 9)],
    ]
    assert [len(c.turns) for c in conversations(path, requests=4)] == [3, 1]  # the last one cut
    assert conversations(path, requests=10, offset=1)[0].first_record == 3
    a, b = (prompt_text(t, 12) for t in convs[0].turns[:2])
    assert b.startswith(block_text(0, 12) + block_text(1, 12)) and a.startswith(block_text(0, 12))
    assert block_text(3, 12) == block_text(3, 12) != block_text(4, 12)
    assert block_text(0, 12).startswith(" ") and block_text(0, 12).endswith(".")


def test_vllm_counters_are_read_from_prometheus_text():
    from bench.router.vllm_fleet import parse_counters

    text = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 320.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 999.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 64.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1000.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0
"""
    c = parse_counters(text)
    assert (c.local_hits, c.external_hits, c.prompt_tokens, c.requests) == (320.0, 64.0, 1000.0, 5.0)
    d = c - parse_counters("vllm:prompt_tokens_total 400.0\n")
    assert d.prompt_tokens == 600.0 and d.local_hits == 320.0
