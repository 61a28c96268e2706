"""bench/store/hybrid_states.py: a hit needs the pages and the state at exactly the cut; the
admission rules and evictions on crafted requests; a tiny run on the real traces."""

import pytest

from bench.store import hybrid_states as hs

B = hs.BLOCK_TOKENS


def req(*chain: int) -> hs.Request:
    return hs.Request(len(chain) * B + 10, chain)  # every block full, plus a partial one


def test_a_hit_needs_the_state_at_exactly_the_cut():
    shared = [req(1, 2, 3), req(1, 2, 4), req(1, 2, 5)]
    total = 3 * (3 * B + 10)
    # every boundary: the second and third requests resume at 2 (pages 1, 2 and the state at 2).
    assert hs.simulate(shared, 0, "infinite", "every", 6) == pytest.approx(4 * B / total)
    # marconi: the first keeps only its prompt end (3): the second misses, and keeps the state
    # at the shared prefix (2), which the third hits.
    assert hs.simulate(shared, 0, "infinite", "marconi", 6) == pytest.approx(2 * B / total)


def test_marconi_admission_keeps_the_prompt_end_and_the_branch_point_only():
    seen = {1, 2}
    assert hs.admitted_states(req(1, 2, 7, 8), seen, "marconi") == [2, 4]
    assert hs.admitted_states(req(9, 10), seen, "marconi") == [2]
    assert hs.admitted_states(req(1, 2), set(), "every") == [1, 2]


def test_lru_under_pressure_loses_the_state_and_with_it_the_hit():
    requests = [req(1, 2), req(3, 4), req(1, 2)]
    # Room for one request's pages and its prompt-end state (2 + 6 units): the third misses.
    assert hs.simulate(requests, 8, "lru", "marconi", 6) == 0.0
    # Room for both: the third resumes at its prompt's end (2 blocks).
    assert hs.simulate(requests, 16, "lru", "marconi", 6) == pytest.approx(2 * B / (3 * (2 * B + 10)))
    # The clairvoyant cache bypasses the second's values (never used again) and keeps the first's
    # pages and state at 1; the state at 2 ties on next use and is bypassed: the third resumes at 1.
    assert hs.simulate(requests, 8, "clairvoyant", "every", 6) == pytest.approx(B / (3 * (2 * B + 10)))


def test_a_tiny_run_on_a_trace_file(tmp_path, capsys):
    import json
    import random

    rng = random.Random(5)
    lines = []
    for i in range(300):  # a few shared system prompts, then private blocks
        head = [rng.randrange(4)]
        chain = head + [1000 + i * 10 + k for k in range(rng.randrange(1, 6))]
        lines.append(json.dumps({"timestamp": i, "input_length": len(chain) * B - 7, "hash_ids": chain}))
    (tmp_path / "tiny_trace.jsonl").write_text("\n".join(lines) + "\n")
    assert hs.main(["--traces", "tiny", "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny: 300 requests" in out and "of clairvoyant" in out
