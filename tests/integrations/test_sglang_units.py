"""The backend's pure parts: settings, key names, prefix folding."""

from __future__ import annotations

import pytest

from gcache.integrations.sglang.keys import KeyLayoutError, PoolKeys, entry_parts, key_builder, pool_tag
from gcache.integrations.sglang.prefix import fold, leading_pages, pages_present, restorable_cuts
from gcache.integrations.sglang.settings import BackendSettings, SettingsError

H = "ab" * 32


def test_settings_read_gcache_keys_and_the_env_fallback():
    s = BackendSettings.from_extra_config(
        {
            "gcache_url": " 10.0.0.1:7600 ",
            "interface_v1": 1,
            "gcache_timeout_s": 0.5,
            "gcache_retries": 3,
            "backend_name": "gcache",
        },
        environ={},
    )
    assert (s.url, s.interface_v1, s.timeout_s, s.retries, s.suspect_s) == ("10.0.0.1:7600", True, 0.5, 3, 1.0)
    assert BackendSettings.from_extra_config({}, environ={"GCACHE_URL": "gcache://m:1"}).url == "gcache://m:1"
    assert BackendSettings.from_extra_config({"interface_v1": 0}, environ={"GCACHE_URL": "h:1"}).interface_v1 is False


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "no GCache address"),
        ({"gcache_url": "nohost"}, "bad GCache address 'nohost'"),
        ({"gcache_url": "h:1", "gcache_retries": 1.5}, "gcache_retries'\\] must be a number in \\[0, 10\\]"),
        ({"gcache_url": "h:1", "gcache_timeout_s": 0}, "gcache_timeout_s"),
        ({"gcache_url": "h:1", "gcache_timeout_s": True}, "gcache_timeout_s"),
        ({"gcache_url": "h:1", "gcache_namespace": ""}, "gcache_namespace"),
        ({"gcache_url": "h:1", "gcache_skip_existing": "yes"}, "gcache_skip_existing"),
        ({"gcache_url": "h:1", "gcache_urll": "x"}, "unknown extra_config key\\(s\\) \\['gcache_urll'\\]"),
        ({"gcache_url": "h:1", "gcache_transport": "udp"}, "gcache_transport'\\] must be one of auto, tcp, shm, rdma"),
    ],
)
def test_bad_settings_are_clear_errors(extra, message):
    with pytest.raises(SettingsError, match=message):
        BackendSettings.from_extra_config(extra, environ={})


class Config:
    """The HiCacheStorageConfig fields the key builder reads."""

    def __init__(self, **over):
        self.model_name, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = "a/b", 1, 4, 0, 1
        self.is_mla_model, self.attn_cp_rank, self.attn_cp_size = False, 0, 1
        self.dcp_rank, self.dcp_size, self.logical_page_size, self.should_split_heads = 0, 1, None, False
        self.__dict__.update(over)


@pytest.mark.parametrize(
    "over, suffix",
    [
        ({}, "_a-b_1_4"),
        ({"is_mla_model": True}, "_a-b"),
        ({"pp_size": 2, "pp_rank": 1}, "_a-b_1_4_2_1"),
        ({"attn_cp_size": 2, "attn_cp_rank": 1}, "_a-b_cp1_2_1_4"),
        ({"is_mla_model": True, "dcp_size": 2, "dcp_rank": 1, "logical_page_size": 64}, "_a-b_dcp1_2_page64"),
        ({"model_name": None}, "_default_1_4"),
    ],
)
def test_rank_suffixes(over, suffix):
    assert key_builder(Config(**over), None).suffix == suffix


def test_unsupported_configs_are_clear_errors():
    with pytest.raises(KeyLayoutError, match="heterogeneous TP"):
        key_builder(Config(should_split_heads=True), None)
    with pytest.raises(KeyLayoutError, match="cannot build GCache keys"):
        key_builder(Config(model_name="bad model!"), None)
    with pytest.raises(KeyLayoutError, match="layout 'page_unified' is not supported"):
        PoolKeys(key_builder(Config(), None), "kv", "page_unified", [("k", None)], "bfloat16")


def test_entry_keys_in_get_page_buffer_meta_order():
    builder = key_builder(Config(), "tenant")
    assert pool_tag("kv") == "full" and pool_tag("swa") == "swa"
    page_first = PoolKeys(builder, "kv", "page_first", entry_parts(2, split_kv=True), "bfloat16")
    assert page_first.entries([H]) == [
        f"tenant/{H}.full-pf-bfloat16-k_a-b_1_4".encode(),
        f"tenant/{H}.full-pf-bfloat16-v_a-b_1_4".encode(),
    ]
    layer_first = PoolKeys(builder, "swa", "layer_first", entry_parts(4, split_kv=True), "float8e4m3fn")
    assert layer_first.entries([H]) == [
        f"tenant/{H}.swa-lf-float8e4m3fn-{p}@g{layer}_a-b_1_4".encode() for layer in (0, 1) for p in "kv"
    ]
    mla = PoolKeys(builder, "kv", "page_head", entry_parts(1, split_kv=False), "bfloat16")
    assert mla.entries([H, H]) == [f"tenant/{H}.full-ph-bfloat16-kv_a-b_1_4".encode()] * 2
    with pytest.raises(KeyLayoutError, match="expected K/V pairs"):
        entry_parts(3, split_kv=True)


def test_prefix_rules():
    assert pages_present([True, True, True, False, True, True], 2) == [True, False, True]
    assert leading_pages([True, False, True]) == 1 and leading_pages([]) == 0
    present = [False, True, True, False, True, True]
    assert restorable_cuts(6, "trailing_pages", 2, present) == [3, 6]
    assert restorable_cuts(6, "trailing_pages", 1, present) == [2, 3, 5, 6]
    assert restorable_cuts(6, "all_pages", 1, present) == []
    assert restorable_cuts(6, "all_pages", 1, [True] * 4 + [False, True]) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="block_groups"):
        restorable_cuts(2, "block_groups", 1, [True, True])
    assert fold(6, [("swa", "trailing_pages", 2, present)]) == (6, {"kv": 6, "swa": 6}, [3, 6])
    indexer = ("idx", "all_pages", 1, [True] * 4 + [False] * 2)
    assert fold(6, [("swa", "trailing_pages", 2, present), indexer]) == (3, {"kv": 6, "swa": 6, "idx": 4}, [3])
    assert fold(0, [("swa", "trailing_pages", 2, [])]) == (0, {}, [])


def test_pools_of_other_element_types_never_share_keys():
    # Equal-sized fp8 variants (or Mamba state dtypes) are different bytes under one model name.
    import torch

    from gcache.integrations.sglang.keys import dtypes_word

    builder = key_builder(Config(), None)
    words = [dtypes_word([torch.empty(1, dtype=d)]) for d in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert words == ["float8e4m3fn", "float8e5m2"]
    e4, e5 = (PoolKeys(builder, "kv", "page_first", entry_parts(2, split_kv=True), w).entries([H]) for w in words)
    assert not set(e4) & set(e5)
    assert (
        dtypes_word([torch.empty(1, dtype=torch.float32), torch.empty(1, dtype=torch.bfloat16)]) == "bfloat16.float32"
    )
    with pytest.raises(KeyLayoutError, match="element types"):
        PoolKeys(builder, "kv", "page_first", entry_parts(2, split_kv=True), "")
