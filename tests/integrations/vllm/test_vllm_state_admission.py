"""`gcache_state_admission=ends` in a real vLLM engine (Nemotron-H-style tiny model, block 128):
prefill runs in 128-token chunks, so vLLM offers the states at 128 and 256 of a 300-token
prompt. "offered" saves both; "ends" saves the prompt's last full boundary (256) and drops the
earlier chunk end, and a fresh engine still loads the prompt at 256 with outputs equal to a
run without the connector."""

from __future__ import annotations

import tempfile

import pytest

import gcache
from gcache.testing.vllm_hybrid_models import write_hybrid
from tests.integrations.vllm.test_vllm_state_groups import NEMOTRON_P, engine, state_key
from tests.support.servers import ServerProcess
from tests.support.vllm_support import run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]

KIND = "nemotron_h"
CHUNKS = dict(block_size=None, prefix_cache_retention_interval=None, max_num_batched_tokens=128)


def chunked(model, prompts, url=None, **extra) -> dict:
    return engine(KIND, model, prompts, url, engine_args=CHUNKS, **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("admission")
    model = write_hybrid(KIND, work / "model")
    sock = f"{tempfile.mkdtemp(prefix='gc-adm-')}/node.sock"
    servers = {
        rule: ServerProcess(work / f"store-{rule}", memory="256MiB", extra_args=["--unix-socket", sock + rule]).start()
        for rule in ("offered", "ends")
    }
    out: dict = {}
    try:
        out["base"] = run_engine(chunked(model, [NEMOTRON_P]), work / "base")
        for rule, server in servers.items():
            spec = chunked(model, [NEMOTRON_P], server.address)
            spec["extra_config"]["gcache_state_admission"] = rule
            out[rule] = run_engine(spec, work / rule)
            keys = [state_key(out[rule], KIND, NEMOTRON_P, b, 0) for b in (128, 256)]
            with gcache.Client(server.address) as client:
                out[f"{rule}_stored"] = client.batch_is_exist(keys)
        out["b"] = run_engine(chunked(model, [NEMOTRON_P], servers["ends"].address), work / "b")
        yield out
    finally:
        for server in servers.values():
            server.kill()


def test_ends_saves_the_prompts_last_boundary_and_drops_earlier_chunk_ends(runs):
    assert runs["offered_stored"] == [True, True]  # the control: both chunk ends were offered
    assert runs["ends_stored"] == [False, True]
    offered = runs["offered"]["counters"]["scheduler"]["state_values_offered"]
    ends = runs["ends"]["counters"]["scheduler"]["state_values_offered"]
    assert ends < offered


def test_a_fresh_engine_loads_the_prompt_at_its_last_boundary(runs):
    base, b = runs["base"]["results"][0], runs["b"]["results"][0]
    assert b["num_cached_tokens"] == 256 and same_output(b, base)
    assert runs["ends"]["results"][0]["num_cached_tokens"] == 0 and same_output(runs["ends"]["results"][0], base)
