"""A synchronous load that fails must not leave wrong KV in the store (issue 37).

vLLM runs the step's forward before it learns that a load failed: the prompt's pages after the
failed one are computed over a block that was never written, and vLLM recomputes them only
after that step. Saved in that step, they were stored under their right keys with wrong bytes;
the recomputed, right pages then found them "already there", and every engine that loaded them
answered wrongly. Here: A stores a prompt's first 4 pages; page 3's stored bytes are corrupted
(its checksum fails); B (fresh, loads in the step) serves the whole prompt, so its load of page
3 fails; page 3 is put back; C (fresh) loads the whole prompt from the store. C's output must
equal a connector-less engine's exactly.
"""

from __future__ import annotations

import pytest

import gcache
from gcache.testing.vllm_models import BLOCK_SIZE, prompt_tokens
from tests.support.servers import shm_server
from tests.support.vllm_store import flip_byte, page_keys
from tests.support.vllm_support import gcache_spec, run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

PROMPT = prompt_tokens(400, 37)  # 12 full pages
STORED = 4  # A stores pages 0..3
BAD = 3  # the page whose load fails in B
SYNC = dict(gcache_prefetch=False, gcache_async_load_min_tokens=1 << 20)  # B's worker reads the store in the step


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("failed-load")
    server, socket = shm_server(work / "store")
    url, model = server.address, models["llama"]
    out = {}
    try:
        out["base"] = run_engine(dict(model=str(model), prompts=[PROMPT]), work / "base")
        head = PROMPT[: STORED * BLOCK_SIZE + 8]
        out["a"] = run_engine(dict(gcache_spec(model, url, [head]), max_tokens=1), work / "a")
        tags = out["a"]["counters"]["value_tags"]
        (bad_keys,) = page_keys(model, PROMPT, tags, pages=[BAD])
        with gcache.Client(url, transport="tcp") as client:
            assert client.batch_is_exist([k for ks in page_keys(model, PROMPT, tags) for k in ks]) == [
                p < STORED for p in range(len(PROMPT) // BLOCK_SIZE) for _ in bad_keys
            ]
            honest = client.get_batch(bad_keys)
        flip_byte(socket, bad_keys[0])
        out["b"] = run_engine(gcache_spec(model, url, [PROMPT], **SYNC), work / "b")
        with gcache.Client(url, transport="tcp") as client:  # page 3's right bytes, back in the store
            client.batch_remove(bad_keys)
            assert client.put_batch(bad_keys, honest) == [True] * len(bad_keys)
        out["c"] = run_engine(gcache_spec(model, url, [PROMPT]), work / "c")
        yield out
    finally:
        server.kill()


def test_the_failed_load_is_recomputed(runs):
    (b,) = runs["b"]["results"]
    worker = runs["b"]["counters"]["worker"]
    assert worker["load_failed_values"] >= 1
    assert same_output(b, runs["base"]["results"][0])


def test_pages_computed_over_the_failed_block_are_not_saved(runs):
    worker = runs["b"]["counters"]["worker"]
    assert worker["save_pages_dropped_load_failed"] == len(PROMPT) // BLOCK_SIZE - BAD - 1  # pages 4..11


def test_an_engine_loading_them_later_answers_as_without_the_connector(runs):
    (c,) = runs["c"]["results"]
    assert c["num_cached_tokens"] == (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # every page from the store
    assert same_output(c, runs["base"]["results"][0])
