"""GCacheConnector's pure parts (no vLLM needed): checkpoint cuts, the hit fold, value keys
per model / layout tag / group / rank and their segments, and the settings' errors."""

from __future__ import annotations

import pytest

from gcache.integrations.vllm.kv import plan
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import (
    GroupTag,
    MMItem,
    PageKeys,
    mla_writer,
    model_tag,
    prompt_page_hashes,
    rank_keys,
    segment_keys,
    value_tag,
)
from gcache.integrations.vllm.kv.settings import ConnectorSettings, SettingsError
from gcache.wire.keys import page_hashes


def test_sliding_tail_pages_follow_vllms_sliding_window_manager():
    assert plan.sliding_tail_pages(32, 32) == 1  # cdiv(31, 32)
    assert plan.sliding_tail_pages(33, 32) == 1
    assert plan.sliding_tail_pages(34, 32) == 2
    assert plan.sliding_tail_pages(4096, 16) == 256
    assert plan.sliding_tail_pages(1, 16) == 1  # at least one page


def test_prompt_cuts_are_every_c_pages_and_the_prompt_end():
    assert plan.prompt_cuts(600, 32, 16) == {16, 18}  # 600 // 32 == 599 // 32 == 18
    assert plan.prompt_cuts(576, 32, 16) == {16, 18, 17}  # 576 = 18 pages: a repeat resumes at 17
    assert plan.prompt_cuts(20, 32, 16) == set()  # no full page
    assert plan.prompt_tail_pages(600, 32, 16, tail=1) == {15, 17}  # cuts {16, 18}, a 1-page tail
    assert plan.prompt_tail_pages(70, 32, 0, tail=4) == {0, 1}  # cut {2}, a 4-page tail


def test_best_cut_needs_every_sliding_group_tail():
    # Local hit 2 pages, full pages stored up to 8; one SWA group with a 2-page tail.
    present = [False, False, True, True, False, False]  # pages 2..7: 4 and 5 stored
    assert plan.best_cut(2, 8, [(2, present)]) == 6
    assert plan.best_cut(2, 5, [(2, present)]) == 2  # cut 5 needs pages 3, 4: 3 missing
    assert plan.best_cut(2, 8, []) == 8  # no SWA group: the full-attention prefix
    # Pages before the local hit are vLLM's own: cut 3 needs pages 1 (local) and 2.
    assert plan.best_cut(2, 3, [(2, [True])]) == 3
    # Two groups: both must serve the cut.
    assert plan.best_cut(0, 4, [(1, [True, True, True, True]), (1, [True, False, True, False])]) == 3


def test_a_prompt_ending_on_a_page_boundary_may_load_its_last_page():
    # Mid-page: the page holding the last token is never loaded (vLLM computes that token).
    assert [plan.loadable_pages(n, 32, last_page=True) for n in (1, 31, 33, 400, 4095)] == [0, 0, 1, 12, 127]
    # On a boundary: every page with the lever, one fewer without it.
    assert [plan.loadable_pages(n, 32, last_page=True) for n in (32, 64, 4096)] == [1, 2, 128]
    assert [plan.loadable_pages(n, 32, last_page=False) for n in (32, 64, 4096)] == [0, 1, 127]
    assert plan.loadable_pages(0, 32, last_page=True) == 0
    # vLLM is told prompt - 1 tokens for a hit of every page, whole pages otherwise.
    assert plan.hit_tokens(4096, 128, 32, 0) == 4095
    assert plan.hit_tokens(4096, 128, 32, 64) == 4031
    assert plan.hit_tokens(4096, 127, 32, 0) == 127 * 32
    assert plan.hit_tokens(400, 12, 32, 32) == 11 * 32
    # ... and it allocates whole pages for them: the last, partly reported page is loaded.
    assert [plan.loaded_pages(t, 32) for t in (4095, 4031, 127 * 32, 31, 32, 0)] == [128, 126, 127, 1, 1, 0]


def test_leading_counts_pages_whose_every_entry_is_there():
    assert plan.leading([True, True, True, False, True, True], 2) == 1
    assert plan.leading([True] * 6, 3) == 2
    assert plan.leading([], 2) == 0


def _group(kind="full", index=0):
    return Group(index, kind, ("l0",), (0,), 32, 0)


TAG = GroupTag(value_tag("HNC", 32, 2, 256, "float32", [(0, [(0, 16384)])], 1), 1)


def test_value_keys_differ_by_model_tag_pool_group_and_rank():
    h = page_hashes(list(range(32)), 32)[0]
    base = PageKeys("org/model", None, 0, 1, False)
    (key,) = base.value_keys(h, _group(), TAG)
    assert key == f"{h}.full-{TAG.tag}@g0_org-model_0_1".encode()
    assert TAG.tag.startswith("HNCk32h2c256float32n1-") and TAG.tag.endswith("s1")

    def tag(**change):
        args = dict(order="HNC", kernel_block=32, heads=2, content_bytes=256, dtype="float32")
        args["layers"] = [(0, [(0, 16384)])]
        args.update(change)
        return GroupTag(value_tag(**args, segments=1), 1)

    others = {
        PageKeys("org/other", None, 0, 1, False).value_keys(h, _group(), TAG)[0],
        base.value_keys(h, _group(), tag(order="NHC"))[0],
        base.value_keys(h, _group(), tag(kernel_block=16))[0],
        base.value_keys(h, _group(), tag(dtype="bfloat16"))[0],
        base.value_keys(h, _group(), tag(heads=4))[0],
        base.value_keys(h, _group(), tag(layers=[(1, [(0, 16384)])]))[0],  # another layer set
        base.value_keys(h, _group(kind="swa"), TAG)[0],
        base.value_keys(h, _group(index=1), TAG)[0],
        PageKeys("org/model", None, 0, 2, False).value_keys(h, _group(), TAG)[0],
        PageKeys("org/model", None, 1, 2, False).value_keys(h, _group(), TAG)[0],
        PageKeys("org/model", "tenant", 0, 1, False).value_keys(h, _group(), TAG)[0],
    }
    assert key not in others and len(others) == 11


def test_a_value_in_segments_has_one_key_per_segment():
    h = page_hashes(list(range(32)), 32)[0]
    tag = GroupTag(value_tag("HNC", 32, 2, 256, "float32", [(0, [(0, 16384)])], 3), 3)
    keys = PageKeys("m", None, 0, 1, False).value_keys(h, _group(), tag)
    assert [k[-3:] for k in keys] == [b"@s0", b"@s1", b"@s2"] and len(set(k[:-3] for k in keys)) == 1
    assert segment_keys(b"k", 1) == [b"k"]


def test_one_rank_writes_each_mla_page_and_the_writers_spread():
    hashes = page_hashes(list(range(32 * 64)), 32)
    writers = [mla_writer(h, 4) for h in hashes]
    assert set(writers) == {0, 1, 2, 3} and writers == [mla_writer(h, 4) for h in hashes]


def test_the_scheduler_asks_for_every_rank_but_mla_shares_one():
    assert [k.builder.tp_rank for k in rank_keys("m", None, 4, False)] == [0, 1, 2, 3]
    mla = rank_keys("m", None, 4, True)
    assert len(mla) == 1 and mla[0].builder.suffix == "_m"


def test_model_tags_are_key_safe():
    assert model_tag("/tmp/models/llama 3") == "tmp-models-llama-3"
    long = model_tag("x" * 500)
    assert len(long) == 96 and long != model_tag("x" * 499)


def test_settings_read_the_url_and_refuse_bad_input():
    s = ConnectorSettings.from_extra_config({"gcache_url": "127.0.0.1:7600", "gcache_checkpoint_pages": 8}, environ={})
    assert (s.url, s.checkpoint_pages, s.verify_checksums) == ("127.0.0.1:7600", 8, True)
    assert ConnectorSettings.from_extra_config({}, environ={"GCACHE_URL": "h:1"}).url == "h:1"
    with pytest.raises(SettingsError, match="no GCache address"):
        ConnectorSettings.from_extra_config({}, environ={})
    with pytest.raises(SettingsError, match="unknown kv_connector_extra_config key"):
        ConnectorSettings.from_extra_config({"gcache_url": "h:1", "gcache_urll": "x"}, environ={})
    with pytest.raises(SettingsError, match="bad GCache address"):
        ConnectorSettings.from_extra_config({"gcache_url": "nohost"}, environ={})
    with pytest.raises(SettingsError, match="gcache_checkpoint_pages"):
        ConnectorSettings.from_extra_config({"gcache_url": "h:1", "gcache_checkpoint_pages": 0}, environ={})
    with pytest.raises(SettingsError, match="true or false"):
        ConnectorSettings.from_extra_config({"gcache_url": "h:1", "gcache_verify_checksums": "yes"}, environ={})


def test_pages_holding_an_image_are_keyed_by_its_content_and_place():
    tokens = list(range(100, 100 + 32 * 6))  # 6 pages; placeholders are the same tokens for any image
    cat, dog = MMItem("cat-hash", 70, 40), MMItem("dog-hash", 70, 40)  # pages 2 and 3 hold the image
    text = prompt_page_hashes(tokens, 32)
    with_cat = prompt_page_hashes(tokens, 32, mm_items=[cat])
    with_dog = prompt_page_hashes(tokens, 32, mm_items=[dog])
    assert with_cat[:2] == text[:2]  # the pages before the image keep the text chain
    assert all(c != t and c != d for c, t, d in zip(with_cat[2:], text[2:], with_dog[2:]))
    assert prompt_page_hashes(tokens, 32, mm_items=[MMItem("cat-hash", 70, 40)]) == with_cat  # same pixels
    moved = prompt_page_hashes(tokens, 32, mm_items=[MMItem("cat-hash", 66, 40)])
    assert moved[:2] == text[:2] and moved[2] != with_cat[2]  # the same image elsewhere is other KV
    salted = prompt_page_hashes(tokens, 32, cache_salt="t", mm_items=[cat])
    assert not set(salted) & set(with_cat)
