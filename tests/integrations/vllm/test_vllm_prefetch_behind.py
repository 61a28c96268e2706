"""A prefetch made when a request arrived reads only the pages past those vLLM then holds. When
vLLM evicts some of those before the request is scheduled, the prefetch does not cover them:
the scheduler must look every page up, never load pages it never asked the store about
(issue 37: such loads failed where the store had evicted the pages too, and a failed load's
step used to save KV computed over the unwritten blocks).

Y's pages 0..3 are gone from the store, 4..8 are there. Engine B (loads only, prefetch on,
no direct loads) computes Y's first 4 pages itself, then gets a long prompt X and Y in one
batch: Y arrives holding 4 pages locally (its prefetch reads 4..8), X's blocks evict some of
them, and Y is scheduled holding fewer. B must answer Y as a connector-less engine does,
without a failed load.
"""

from __future__ import annotations

import pytest

import gcache
from gcache.testing.vllm_models import BLOCK_SIZE, prompt_tokens
from tests.support.servers import shm_server
from tests.support.vllm_store import page_keys
from tests.support.vllm_support import gcache_spec, run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

Y = prompt_tokens(300, 71)  # 9 full pages
HEAD = 4  # pages of Y that B holds when Y arrives, and that the store lacks
X = prompt_tokens(1150, 72)  # 37 blocks with its output: evicts some of Y's
# 40 blocks of KV (tiny llama: 1 KiB a token): X and Y do not fit at once.
SMALL_KV = dict(kv_cache_bytes=40 * BLOCK_SIZE * 1024, max_model_len=1200, max_tokens=8)


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("prefetch-behind")
    server, _ = shm_server(work / "store")
    url, model = server.address, models["llama"]
    out = {}
    try:
        out["base"] = run_engine(dict(model=str(model), prompts=[Y], **SMALL_KV), work / "base")
        out["a"] = run_engine(dict(gcache_spec(model, url, [Y]), max_tokens=1), work / "a")
        tags = out["a"]["counters"]["value_tags"]
        with gcache.Client(url, transport="tcp") as client:
            assert client.batch_remove([k for ks in page_keys(model, Y, tags, pages=range(HEAD)) for k in ks])
        spec = dict(
            gcache_spec(model, url, [Y[: HEAD * BLOCK_SIZE + 8], X, Y], gcache_direct_loads=False),
            kv_role="kv_consumer",  # B saves nothing: Y's first pages stay out of the store
            batches=[[0], [1, 2]],
            **SMALL_KV,
        )
        out["b"] = run_engine(spec, work / "b")
        yield out
    finally:
        server.kill()


def test_the_late_request_is_looked_up_not_loaded_blind(runs):
    counters = runs["b"]["counters"]
    assert counters["worker"]["load_failed_values"] == 0
    assert counters["scheduler"]["prefetch_behind"] >= 1


def test_its_output_equals_a_connector_less_engine(runs):
    assert same_output(runs["b"]["results"][2], runs["base"]["results"][0])
