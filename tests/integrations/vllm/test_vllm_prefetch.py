"""GCacheConnector's prefetch and load choice in a real vLLM engine (Llama-style tiny model):
a request's prefix is read into staging when it arrives (on_new_request), and the scheduler
plans a copy from staging once it is there. With a same-host store over shared memory the
connector loads straight from it instead (test_vllm_llama.py), so these engines set
gcache_direct_loads off: the staging path is what a remote store or a GPU gets.

One store; A saves every prompt; a fresh engine B then serves, between gates: a plain hit; a
request arriving while the store is paused (SIGSTOP: a store that does not answer), which
waits at most gcache_prefetch_wait_s and is recomputed; a request aborted while its prefetch
waits on that store; after the store resumes, a hit again; a page whose bytes were flipped in
the store (the prefetch's checksum check cuts the hit there). A batch engine runs four
prompts at once in a KV cache too small for them (vLLM preempts and resumes) with a prefetch
staging too small for all four (the rest are looked up when asked). Every output equals a
connector-less run's (greedy); no staging slot is left taken and nothing is in flight at the
end; staging never exceeds its size.
"""

from __future__ import annotations

import signal

import pytest

from gcache.testing.vllm_models import BLOCK_SIZE, prompt_tokens
from tests.support.servers import shm_server
from tests.support.vllm_store import PAGE_BYTES, flip_byte, page_keys
from tests.support.vllm_support import EngineRun, gcache_spec, run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

LAYERS = 2
VALUE_BYTES = LAYERS * PAGE_BYTES  # one value holds a page of both layers
P1, P2, P3, P4 = (prompt_tokens(200, seed) for seed in (11, 12, 13, 14))  # 6 full pages each
PAGES = 200 // BLOCK_SIZE
BATCH = [prompt_tokens(300, seed) for seed in (21, 22, 23, 24)]  # 9 full pages each
BATCH_PAGES = 299 // BLOCK_SIZE
# The batch: 32 blocks of KV for 4 x (300 + 200) tokens: vLLM admits three (10 blocks each)
# and preempts as they grow to 16; 1 MiB of prefetch staging = 32 values: three prompts'
# prefixes fit, the fourth is looked up when asked.
SMALL_KV = dict(kv_cache_bytes=32 * BLOCK_SIZE * LAYERS * 2 * 32 * 4 * 2, max_model_len=512, max_tokens=200)
PREFETCH_MIB = 1


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("prefetch")
    server, socket = shm_server(work / "store")
    url, model = server.address, models["llama"]
    out: dict = {}
    try:
        out["base"] = run_engine(dict(model=str(model), prompts=[P1, P2, P3, P4]), work / "base")
        out["base_batch"] = run_engine(dict(model=str(model), prompts=BATCH, together=True, **SMALL_KV), work / "bb")
        out["a"] = run_engine(dict(gcache_spec(model, url, [P1, P2, P3, P4, *BATCH]), max_tokens=1), work / "a")
        tags = out["a"]["counters"]["value_tags"]
        # A store that does not answer: long client timeouts, so only the prefetch's own wait ends it.
        extra = dict(gcache_prefetch_wait_s=0.5, gcache_timeout_s=30.0, gcache_suspect_s=0.0, gcache_direct_loads=False)
        spec = dict(gcache_spec(model, url, [P1, P2, P3, P3, P4], **extra), gates=[1, 3, 4], abort_prompts=[2])
        b = EngineRun(dict(spec, reset_between=True), work / "b")
        try:
            b.wait_gate(1)
            server.proc.send_signal(signal.SIGSTOP)  # P2 arrives, then P3 arrives and is aborted
            b.open_gate(1)
            b.wait_gate(3)
            server.proc.send_signal(signal.SIGCONT)
            b.open_gate(3)
            b.wait_gate(4)
            flip_byte(socket, page_keys(model, P4, tags, pages=[2])[0][0])
            b.open_gate(4)
            out["b"] = b.result()
        finally:
            server.proc.send_signal(signal.SIGCONT)
            b.kill()
        staging = dict(gcache_prefetch_mib=PREFETCH_MIB, gcache_direct_loads=False)
        batch = dict(gcache_spec(model, url, BATCH, **staging), together=True, **SMALL_KV)
        out["batch"] = run_engine(batch, work / "batch")
        yield out
    finally:
        server.kill()


def test_a_hit_is_prefetched_and_copied_from_staging(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert b[0]["num_cached_tokens"] == PAGES * BLOCK_SIZE
    assert same_output(b[0], base[0])
    scheduler = runs["b"]["counters"]["scheduler"]
    assert scheduler["prefetches"] >= 3 and scheduler["loads_staged"] >= 2  # P1 and P3 after the pause
    assert runs["b"]["counters"]["worker"]["staged_values_loaded"] >= 2 * PAGES
    assert runs["b"]["counters"]["worker"]["values_loaded"] == 0  # no store read in the worker


def test_a_request_arriving_while_the_store_is_paused_is_recomputed_not_held(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert b[1]["num_cached_tokens"] == 0  # P2: the store never answered
    assert same_output(b[1], base[1])
    assert runs["b"]["counters"]["scheduler"]["prefetch_timeouts"] >= 1


def test_a_request_aborted_while_its_prefetch_waits_leaks_nothing(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert b[2] == {"aborted": True}
    assert b[3]["num_cached_tokens"] == PAGES * BLOCK_SIZE  # P3 again, the store back
    assert same_output(b[3], base[2])
    scheduler = runs["b"]["counters"]["scheduler"]
    assert scheduler["prefetch_cancelled"] >= 1
    assert scheduler["prefetch_in_flight"] == 0
    assert scheduler["prefetch_slots_free"] == scheduler["prefetch_slots"]


def test_a_flipped_page_cuts_the_prefetched_hit_and_is_removed(runs):
    b, base = runs["b"]["results"], runs["base"]["results"]
    assert b[4]["num_cached_tokens"] == 2 * BLOCK_SIZE  # P4: pages 0-1; page 2 failed its checksum
    assert same_output(b[4], base[3])
    assert runs["b"]["counters"]["scheduler"]["corrupt_values_removed"] == 1


def test_preempted_batch_with_bounded_staging_matches_the_connectorless_run(runs):
    batch, base = runs["batch"], runs["base_batch"]["results"]
    assert [r["tokens"] for r in batch["results"]] == [r["tokens"] for r in base]
    scheduler = batch["counters"]["scheduler"]
    assert scheduler["requests_preempted"] >= 1
    assert scheduler["prefetch_slots"] == (PREFETCH_MIB << 20) // VALUE_BYTES  # the bound
    assert scheduler["prefetch_refused"] >= 1  # not every prefix fit: those were looked up
    assert scheduler["loads_staged"] >= 1
    assert scheduler["hit_tokens"] >= 2 * BATCH_PAGES * BLOCK_SIZE
    assert scheduler["prefetch_in_flight"] == 0
    assert scheduler["prefetch_slots_free"] == scheduler["prefetch_slots"]
