"""bench/cluster/ring_remap.py's placements and bench/store's agent traces and in-process
replay (issue 21): tiny runs, exact properties."""

from __future__ import annotations

import json

from bench.cluster import ring_remap
from bench.store import eviction_inproc
from bench.store.agent_traces import SHAPES, agent_trace


def test_ring_remap_rendezvous_moves_only_the_changed_nodes_keys(capsys):
    assert ring_remap.main(["--nodes", "3,5", "--keys", "2000", "--weights", "mixed,random", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["placement"] for r in rows} == set(ring_remap.KINDS)
    for r in rows:
        if r["placement"] != "ketama":  # the old ring moves keys between staying nodes
            assert [r[c]["violations"] for c in ("join", "leave", "reweight")] == [0, 0, 0], r
            assert r["join"]["fallback_wrong"] == r["leave"]["fallback_wrong"] == 0


def test_agent_traces_are_prefix_chains_and_deterministic():
    for shape in SHAPES:
        trace = agent_trace(shape, 3, 200)
        assert len(trace.chains) == 200 and trace == agent_trace(shape, 3, 200)
        parent = {}  # equal ids are equal prefixes: an id always follows the same id
        for chain in trace.chains:
            for prev, block in zip([None] + chain[:-1], chain):
                assert parent.setdefault(block, prev) == prev, (shape, block)


def test_eviction_inproc_replays_chain_and_lru(capsys):
    argv = ["--traces", "agent", "--seeds", "0", "--requests", "150", "--fractions", "0.25", "--disk", "off", "--json"]
    assert eviction_inproc.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == len(SHAPES)
    assert all(0 <= r["chain"] <= 1 and 0 <= r["lru"] <= 1 for r in out["rows"])
