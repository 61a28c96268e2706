"""The KV of multimodal prompts through GCacheConnector, with the encoder cache beside it, in
real vLLM engines (tiny LLaVA, a llama or an all-sliding Mistral-style text tower).

An image's placeholder tokens are the same for every image, so the connector's page keys hash
the items a page holds (keys.prompt_page_hashes). Engine A (both connectors) serves a prompt
with an image; a fresh engine B serves it again with vLLM's own caches emptied: the whole
prompt's full pages come from the store and the encoder never runs; the same text with another
image hits only the text pages before the image, runs the encoder, and differs. Every output
equals a connector-less run's exactly."""

from __future__ import annotations

import pytest

from gcache.testing.vllm_mm import prompt
from gcache.testing.vllm_models import BLOCK_SIZE
from tests.support.vllm_support import CONNECTOR, ec_spec, run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

TEXT = prompt(40, 70, seed=7)  # BOS + 40 words (page 0 is text only), one image, 70 words


def with_image(seed: int) -> dict:
    return {"text": TEXT, "images": [{"seed": seed}]}


def both(model, url: str, prompts: list) -> dict:
    """An engine with both connectors on the store at `url`, vLLM's caches emptied per prompt."""
    kv = dict(CONNECTOR, extra_config={"gcache_url": url})
    return dict(ec_spec(model, url, prompts), **kv, reset_between=True)


def encoder_runs(run: dict, i: int) -> int:
    now = run["results"][i]["ec"]["scheduler"]["items_encoded"]
    return now - (run["results"][i - 1]["ec"]["scheduler"]["items_encoded"] if i else 0)


@pytest.mark.parametrize("name", ["llava", "llava_mistral"])
def test_an_image_prompts_kv_is_stored_keyed_by_the_image(models, server_factory, tmp_path, name):
    model, server = models[name], server_factory(name)
    base = run_engine(dict(model=str(model), mm=True, prompts=[with_image(1), with_image(2)]), tmp_path / "base")
    a = run_engine(both(model, server.address, [with_image(1)]), tmp_path / "a")
    b = run_engine(both(model, server.address, [with_image(1), with_image(2)]), tmp_path / "b")
    if name == "llava_mistral":
        assert b["counters"]["kv_cache_groups"] == ["SlidingWindowSpec"]  # the hybrid manager's group
    prompt_tokens = b["results"][0]["num_prompt_tokens"]
    full_pages = (prompt_tokens - 1) // BLOCK_SIZE
    assert full_pages >= 3
    assert a["counters"]["worker"]["values_saved"] >= 1
    # The same image: every full page from the store, the encoder never runs.
    assert b["results"][0]["num_cached_tokens"] == full_pages * BLOCK_SIZE
    assert encoder_runs(b, 0) == 0
    assert same_output(b["results"][0], base["results"][0])
    # Another image, the same text: only page 0 (text before the image) is shared.
    if name == "llava":  # an all-sliding tower stores only checkpoint tails: no hit at page 1
        assert b["results"][1]["num_cached_tokens"] == BLOCK_SIZE
    assert b["results"][1]["num_cached_tokens"] < full_pages * BLOCK_SIZE
    assert encoder_runs(b, 1) == 1
    assert same_output(b["results"][1], base["results"][1])
    if name == "llava":  # (an all-sliding tower's window of 32 tokens has left the image by the end)
        assert (b["results"][1]["tokens"], b["results"][1]["logprobs"]) != (
            b["results"][0]["tokens"],
            b["results"][0]["logprobs"],
        )
