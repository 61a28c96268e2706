"""GCacheConnector with sliding-window models in a real vLLM engine.

Gemma2-style (alternating sliding / full layers, window 32 = one block): the connector
declares SupportsHMA, so vLLM keeps its hybrid KV manager on (two KV cache groups). The
sliding-window group is stored only at checkpoints (every C = 16 pages and the prompt's
end), and a fresh process hits exactly as long a prefix as when every sliding-window page is
stored. Mistral-style (every layer sliding): one sliding-window group, the same rules.
"""

from __future__ import annotations

import tempfile

import pytest

import gcache
from gcache.common.attention import AttentionKind
from gcache.testing.vllm_models import BLOCK_SIZE, prompt_tokens
from tests.support.servers import ServerProcess
from tests.support.vllm_store import PAGE_BYTES, flip_byte, page_keys
from tests.support.vllm_support import gcache_spec, run_engine, same_first_token, same_output

# One module fixture runs several engine processes: its setup needs more than the default timeout.
pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

P = prompt_tokens(600, 21)  # 18 full pages (+24 tokens): checkpoints at 16 and 18
S = prompt_tokens(60, 22)
PAGES = 600 // BLOCK_SIZE
SWA_LAYERS, FULL_LAYERS = (0, 2), (1, 3)
CHECKPOINT_TAILS = [15, 17]  # the pages before the cuts 16 and 18 (a window of one page)


@pytest.fixture(scope="module")
def gemma(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("gemma2")
    sock = f"{tempfile.mkdtemp(prefix='gc-vllm-')}/node.sock"  # a socket path must stay short
    server = ServerProcess(work / "store", memory="128MiB", extra_args=["--unix-socket", sock]).start()
    url, model = server.address, models["gemma2"]
    every = dict(gcache_swa_every_page=True, gcache_namespace="every-page")
    out = {"model": model}
    try:
        out["base"] = run_engine(dict(model=str(model), prompts=[P + S, P]), work / "base")
        # One token: the prompt's pages (and its sliding-window tails) are saved by its one step.
        out["a"] = run_engine(dict(gcache_spec(model, url, [P]), max_tokens=1), work / "a")
        out["b"] = run_engine(gcache_spec(model, url, [P + S, P]), work / "b")
        out["a_every"] = run_engine(gcache_spec(model, url, [P], **every), work / "a-every")
        out["b_every"] = run_engine(gcache_spec(model, url, [P + S, P], **every), work / "b-every")
        with gcache.Client(url, transport="tcp") as client:
            tags = out["a"]["counters"]["value_tags"]
            swa = page_keys(model, P, tags, AttentionKind.SWA)
            out["swa_stored"] = [p for p, keys in enumerate(swa) if all(client.batch_is_exist(keys))]
            full = page_keys(model, P, tags, AttentionKind.FULL)
            out["full_stored"] = [p for p, keys in enumerate(full) if all(client.batch_is_exist(keys))]
        # A flipped byte in a full-attention page: vLLM reports per-block load errors only for
        # one KV group, so the hybrid load fails as a whole and vLLM recomputes the request.
        flip_byte(sock, full[5][0])
        out["b_flipped"] = run_engine(gcache_spec(model, url, [P + S]), work / "b-flipped")
        yield out
    finally:
        server.kill()


def test_the_hybrid_kv_manager_stays_on(gemma):
    for run in ("a", "b", "a_every", "b_every"):
        assert gemma[run]["counters"]["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
        assert "Turning off hybrid kv cache manager" not in gemma[run]["log"]


def test_sliding_window_kv_is_stored_only_at_checkpoints(gemma):
    assert gemma["full_stored"] == list(range(PAGES))
    assert gemma["swa_stored"] == CHECKPOINT_TAILS
    a, every = gemma["a"]["counters"]["worker"], gemma["a_every"]["counters"]["worker"]
    # One value per (page, group) holds the group's layers.
    assert a["swa_values_saved"] == len(CHECKPOINT_TAILS)
    assert every["swa_values_saved"] == PAGES
    assert a["values_saved"] == PAGES + len(CHECKPOINT_TAILS)
    full_bytes = PAGES * len(FULL_LAYERS) * PAGE_BYTES
    assert a["bytes_saved"] == full_bytes + len(CHECKPOINT_TAILS) * len(SWA_LAYERS) * PAGE_BYTES
    assert every["bytes_saved"] == full_bytes + PAGES * len(SWA_LAYERS) * PAGE_BYTES


def test_a_fresh_process_hits_as_far_as_with_every_page_and_matches_exactly(gemma):
    base, b, b_every = gemma["base"]["results"], gemma["b"]["results"], gemma["b_every"]["results"]
    hits = [r["num_cached_tokens"] for r in b]
    assert hits[0] == PAGES * BLOCK_SIZE  # P + S resumes at the end of P
    assert hits == [r["num_cached_tokens"] for r in b_every]
    assert gemma["b"]["counters"]["scheduler"]["hit_tokens"] >= PAGES * BLOCK_SIZE
    for got, every, want in zip(b, b_every, base):
        assert same_output(got, want)
        assert same_output(every, want)
    assert same_first_token(gemma["a"]["results"][0], base[1])


def test_all_sliding_mistral_hits_at_the_checkpoint_and_matches(models, server_factory, tmp_path):
    server = server_factory("mistral")
    model = models["mistral"]
    base = run_engine(dict(model=str(model), prompts=[P + S, P]), tmp_path / "base")["results"]
    a = run_engine(gcache_spec(model, server.address, [P]), tmp_path / "a")
    b = run_engine(gcache_spec(model, server.address, [P + S, P]), tmp_path / "b")
    assert a["counters"]["kv_cache_groups"] == ["SlidingWindowSpec"]
    assert a["counters"]["worker"]["swa_values_saved"] == len(CHECKPOINT_TAILS)
    assert a["counters"]["worker"]["bytes_saved"] == len(CHECKPOINT_TAILS) * 2 * PAGE_BYTES  # 2 layers each
    assert b["results"][0]["num_cached_tokens"] == PAGES * BLOCK_SIZE
    for got, want in zip(b["results"], base):
        assert same_output(got, want)


def test_a_flipped_page_fails_the_hybrid_load_and_the_request_is_recomputed(gemma):
    flipped = gemma["b_flipped"]
    assert same_output(flipped["results"][0], gemma["base"]["results"][0])
    assert flipped["counters"]["worker"]["load_failed_values"] == 1
    assert flipped["counters"]["worker"]["corrupt_values_removed"] == 1
    assert flipped["counters"]["scheduler"]["loads_async"] == 1
