"""A prompt that ends on a page boundary loads its last page too (plan.loadable_pages), in real
vLLM engines: vLLM is told prompt - 1 tokens, recomputes only the last token over the loaded
page, and answers exactly as an engine without the connector. Engine A stores two prompts, one
of exactly 12 pages and one ending mid-page; fresh engines B load them: in the step (direct
from the store's shared memory), between steps, through the prefetch's staging, and with
the rule off (the last page recomputed, as before).
"""

from __future__ import annotations

import pytest

import gcache
from gcache.testing.vllm_models import BLOCK_SIZE, prompt_tokens
from tests.support.servers import shm_server
from tests.support.vllm_store import page_keys
from tests.support.vllm_support import gcache_spec, run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]

PAGES = 12
ALIGNED = prompt_tokens(PAGES * BLOCK_SIZE, 81)  # ends on a page boundary
MID = prompt_tokens(PAGES * BLOCK_SIZE + 16, 82)  # ends mid-page: 12 full pages
PROMPTS = [ALIGNED, MID]
SYNC = dict(gcache_async_load_min_tokens=1 << 20)
B_RUNS = {
    "sync": SYNC,  # direct loads, in the step
    "async": dict(gcache_async_load_min_tokens=1),  # direct loads, between steps
    "staged": dict(gcache_direct_loads=False),  # prefetch on arrival, copied from staging
    "off": dict(SYNC, gcache_load_last_page=False),
}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("last-page")
    server, _ = shm_server(work / "store")
    url, model = server.address, models["llama"]
    out = {}
    try:
        out["base"] = run_engine(dict(model=str(model), prompts=PROMPTS), work / "base")
        out["a"] = run_engine(gcache_spec(model, url, PROMPTS), work / "a")
        tags = out["a"]["counters"]["value_tags"]
        with gcache.Client(url, transport="tcp") as client:
            out["stored"] = [
                client.batch_is_exist([k for ks in page_keys(model, p, tags) for k in ks]) for p in PROMPTS
            ]
        for name, config in B_RUNS.items():
            out[name] = run_engine(gcache_spec(model, url, PROMPTS, **config), work / name)
        yield out
    finally:
        server.kill()


def test_a_stores_every_full_page_including_the_last(runs):
    assert [len(flags) for flags in runs["stored"]] == [PAGES, PAGES]
    assert all(all(flags) for flags in runs["stored"])


@pytest.mark.parametrize("name", ["sync", "async", "staged"])
def test_b_loads_all_but_the_last_token_and_answers_as_without_the_connector(runs, name):
    aligned, mid = runs[name]["results"]
    base_aligned, base_mid = runs["base"]["results"]
    assert aligned["num_cached_tokens"] == len(ALIGNED) - 1  # every page, the last one too
    assert mid["num_cached_tokens"] == PAGES * BLOCK_SIZE  # mid-page: its full pages, as before
    scheduler = runs[name]["counters"]["scheduler"]
    assert scheduler["hit_tokens"] == len(ALIGNED) - 1 + PAGES * BLOCK_SIZE
    worker = runs[name]["counters"]["worker"]
    assert worker["load_failed_values"] == 0
    assert same_output(aligned, base_aligned)
    assert same_output(mid, base_mid)


def test_each_b_loaded_as_asked(runs):
    for name, kind in (("sync", "loads_sync"), ("async", "loads_async"), ("staged", "loads_staged")):
        assert runs[name]["counters"]["scheduler"].get(kind) == 2, name


def test_with_the_rule_off_the_last_page_is_recomputed(runs):
    aligned, mid = runs["off"]["results"]
    assert aligned["num_cached_tokens"] == len(ALIGNED) - BLOCK_SIZE
    assert mid["num_cached_tokens"] == PAGES * BLOCK_SIZE
    assert same_output(aligned, runs["base"]["results"][0])
