"""GCacheConnector in a real vLLM engine, Llama-style model (one full-attention KV group).

One store, then fresh engine processes in turn: a connector-less baseline, A (cold: saves),
another model (never hits A's pages), and B (prefetch off: the worker reads the store, straight
from its shared memory into the KV blocks: the direct load),
which serves four prompts and between them has the store changed under it: a page's bytes
flipped in the server's memory, a middle page removed, the server killed. B's every output equals the baseline's exactly (tokens and
top-3 logprobs); only its hit counts differ.
"""

from __future__ import annotations

import pytest

import gcache
from gcache.testing.vllm_models import BLOCK_SIZE, prompt_tokens
from tests.support.servers import shm_server
from tests.support.vllm_store import PAGE_BYTES, flip_byte, page_keys
from tests.support.vllm_support import EngineRun, gcache_spec, run_engine, same_first_token, same_output

# One module fixture runs several engine processes: its setup needs more than the default timeout.
pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

LAYERS = 2
P1, P2, P3, P4 = (prompt_tokens(200, seed) for seed in (1, 2, 3, 4))  # 6 full pages each
S1 = prompt_tokens(50, 9)
PAGES = 200 // BLOCK_SIZE


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("llama")
    server, socket = shm_server(work / "store")
    url, model = server.address, models["llama"]
    out = {"server": server, "socket": socket, "model": model}
    try:
        out["base"] = run_engine(dict(model=str(model), prompts=[P1 + S1, P2, P3, P4, P1]), work / "base")
        # One token per prompt: each prompt's pages must be saved by its own (only) step.
        out["a"] = run_engine(dict(gcache_spec(model, url, [P1, P2, P3, P4]), max_tokens=1), work / "a")
        out["other"] = run_engine(gcache_spec(models["llama_other"], url, [P1]), work / "other")
        tags = out["a"]["counters"]["value_tags"]
        with gcache.Client(url, transport="tcp") as client:
            out["stored"] = client.batch_is_exist(
                [k for p in (P1, P2, P3, P4) for ks in page_keys(model, p, tags) for k in ks]
            )
        # The lookup-and-load path (the worker reads the store); test_vllm_prefetch.py runs the
        # prefetch path, which reads the store when a request arrives.
        spec = dict(
            gcache_spec(model, url, [P1 + S1, P2, P3, P4], gcache_suspect_s=600, gcache_prefetch=False), gates=[1, 2, 3]
        )
        b = EngineRun(spec, work / "b")
        try:
            b.wait_gate(1)
            flip_byte(out["socket"], page_keys(model, P2, tags, pages=[2])[0][0])  # page 2's value
            b.open_gate(1)
            b.wait_gate(2)
            with gcache.Client(url, transport="tcp") as client:
                assert client.batch_remove(page_keys(model, P3, tags, pages=[2])[0]) == [True]
            b.open_gate(2)
            b.wait_gate(3)
            server.kill()
            b.open_gate(3)
            out["b"] = b.result()
        finally:
            b.kill()
        yield out
    finally:
        server.kill()


def test_cold_process_saves_every_page_of_every_prompt(runs):
    a = runs["a"]
    assert [r["num_cached_tokens"] for r in a["results"]] == [0, 0, 0, 0]
    worker = a["counters"]["worker"]
    assert worker["values_saved"] == 4 * PAGES  # one value per page holds both layers
    assert worker["bytes_saved"] == 4 * PAGES * LAYERS * PAGE_BYTES
    assert worker["save_pages_dropped"] == worker["save_pages_dropped_staging"] == worker["store_errors"] == 0
    assert runs["stored"] == [True] * (4 * PAGES)
    base = runs["base"]["results"]
    assert same_first_token(a["results"][0], base[4])  # P1
    for i in (1, 2, 3):
        assert same_first_token(a["results"][i], base[i])


def test_fresh_process_hits_and_matches_the_connectorless_run_exactly(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert b[0]["num_cached_tokens"] == PAGES * BLOCK_SIZE  # P1's 6 pages, from the store
    assert same_output(b[0], base[0])
    assert runs["b"]["counters"]["scheduler"]["loads_sync"] >= 1
    worker = runs["b"]["counters"]["worker"]
    assert worker["values_loaded_direct"] == worker["values_loaded"] >= PAGES  # arena -> blocks, no staging


def test_a_page_with_flipped_bytes_is_recomputed_not_served(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert same_output(b[1], base[1])  # P2: its page 2 failed its checksum
    worker = runs["b"]["counters"]["worker"]
    assert worker["load_failed_values"] == 1
    assert worker["corrupt_values_removed"] == 1  # so a later save stores good bytes again


def test_a_removed_middle_page_shortens_the_hit(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert b[2]["num_cached_tokens"] == 2 * BLOCK_SIZE  # P3: pages 0-1 only
    assert same_output(b[2], base[2])


def test_a_killed_store_is_misses_and_the_same_output(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert b[3]["num_cached_tokens"] == 0  # P4: the server is gone
    assert same_output(b[3], base[3])
    scheduler = runs["b"]["counters"]["scheduler"]
    assert scheduler["store_errors"] + scheduler["calls_while_suspect"] >= 1
    # Hits: P1's 6 pages, P2's 6 (one failed to load), P3's 2, P4 none.
    assert scheduler["hit_tokens"] == (PAGES + PAGES + 2) * BLOCK_SIZE


def test_another_model_never_reads_these_pages(runs):
    other = runs["other"]
    assert other["results"][0]["num_cached_tokens"] == 0
    assert other["counters"]["scheduler"]["hit_tokens"] == 0
    assert other["counters"]["worker"]["values_saved"] == PAGES  # its own pages, its own keys


def test_an_unreachable_store_stops_the_engine_start_with_a_clear_error(models, tmp_path):
    from gcache.common.processes import free_port

    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    run = EngineRun(gcache_spec(models["llama"], url, [P1]), tmp_path / "unreachable")
    with pytest.raises(AssertionError, match=f"GCacheConnector: cannot reach the store at {url}"):
        run.result()
