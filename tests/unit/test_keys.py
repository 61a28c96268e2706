"""gcache.wire.keys: SGLang-compatible page hashes and the store key layout."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.errors import InvalidArgumentError, KeyInvalidError
from gcache.wire.keys import KeyBuilder, get_hash_str, page_hashes

# sha256(u32le(1) u32le(2) u32le(3) u32le(4)), computed independently below.
PAGE_1_2_3_4 = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
# the next page [5, 6, 7, 8] chained onto it
PAGE_5_6_7_8_AFTER = "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"


def sglang_get_hash_str(token_ids, prior_hash=None):
    """SGLang's python/sglang/srt/mem_cache/hicache_storage.py get_hash_str, as it reads."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        if isinstance(t, tuple):
            for elem in t:
                hasher.update(elem.to_bytes(4, byteorder="little", signed=False))
        else:
            hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def test_vector_first_page():
    raw = bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0])
    assert hashlib.sha256(raw).hexdigest() == PAGE_1_2_3_4
    assert get_hash_str([1, 2, 3, 4]) == PAGE_1_2_3_4


def test_vector_chained_page():
    raw = bytes.fromhex(PAGE_1_2_3_4) + bytes([5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 8, 0, 0, 0])
    assert hashlib.sha256(raw).hexdigest() == PAGE_5_6_7_8_AFTER
    assert get_hash_str([5, 6, 7, 8], PAGE_1_2_3_4) == PAGE_5_6_7_8_AFTER


def test_empty_prior_hash_means_sequence_start():
    assert get_hash_str([1, 2, 3, 4], "") == PAGE_1_2_3_4


def test_bigram_tuples_hash_each_element():
    assert get_hash_str([(1, 2), (3, 4)]) == PAGE_1_2_3_4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.booleans())
def test_matches_sglang_reference(tokens, chained):
    prior = PAGE_1_2_3_4 if chained else None
    assert get_hash_str(tokens, prior) == sglang_get_hash_str(tokens, prior)


def test_page_hashes_full_pages_only_and_chained():
    assert page_hashes(list(range(1, 11)), 4) == [PAGE_1_2_3_4, PAGE_5_6_7_8_AFTER]
    assert page_hashes([1, 2, 3], 4) == []


def test_page_hashes_can_resume_from_a_prior_hash():
    whole = page_hashes(list(range(1, 13)), 4)
    tail = page_hashes(list(range(5, 13)), 4, prior_hash=whole[0])
    assert tail == whole[1:]


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7"])
def test_bad_token_ids_rejected(bad):
    with pytest.raises(InvalidArgumentError):
        get_hash_str([1, bad])


def test_bad_page_size_rejected():
    with pytest.raises(InvalidArgumentError):
        page_hashes([1, 2], 0)


def test_key_layout():
    builder = KeyBuilder(model="meta-llama/Llama-3-8B", namespace="tenant-a", tp_rank=1, tp_size=2)
    assert builder.key(PAGE_1_2_3_4) == f"tenant-a/{PAGE_1_2_3_4}.full_meta-llama-Llama-3-8B_1_2".encode()
    assert (
        builder.key(PAGE_1_2_3_4, pool="swa", layer_group=3)
        == f"tenant-a/{PAGE_1_2_3_4}.swa@g3_meta-llama-Llama-3-8B_1_2".encode()
    )


def test_key_layout_mla_and_pipeline_parallel():
    builder = KeyBuilder(model="m", is_mla=True, pp_rank=1, pp_size=4)
    assert builder.key("ab") == b"ab.full_m_4_1"


def test_keys_differ_by_every_part():
    base = KeyBuilder(model="m")
    variants = {
        base.key("ab"),
        base.key("ab", pool="swa"),
        base.key("ab", layer_group=0),
        KeyBuilder(model="m", namespace="t").key("ab"),
        KeyBuilder(model="m2").key("ab"),
        KeyBuilder(model="m", tp_rank=1, tp_size=2).key("ab"),
    }
    assert len(variants) == 6


def test_key_builder_rejects_bad_parts():
    with pytest.raises(InvalidArgumentError):
        KeyBuilder(model="m", namespace="a/b")
    with pytest.raises(InvalidArgumentError):
        KeyBuilder(model="m", tp_rank=2, tp_size=2)
    with pytest.raises(InvalidArgumentError):
        KeyBuilder(model="m").key("ab", pool="full swa")
    with pytest.raises(KeyInvalidError):
        KeyBuilder(model="m").key("")


def test_key_longer_than_512_bytes_rejected():
    builder = KeyBuilder(model="m" * 300, namespace="n" * 200)
    with pytest.raises(KeyInvalidError):
        builder.key(PAGE_1_2_3_4)


def test_keys_helper_builds_one_key_per_hash():
    builder = KeyBuilder(model="m")
    hashes = page_hashes(list(range(1, 13)), 4)
    assert builder.keys(hashes, pool="swa") == [builder.key(h, pool="swa") for h in hashes]
