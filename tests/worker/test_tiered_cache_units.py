"""Small units under the cache hierarchy: page-hash chains, window-safe ends, the L2 index.

Each is checked against an independent oracle (the plain-Python hash chain, a brute-force
definition of "window-safe", a model of which host pages must survive).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.common.attention import AttentionKind
from gcache.serving.swa_window import last_safe_end, tail_start_page
from gcache.wire.keys import TOKEN_ID_MAX, get_hash_str, page_hashes, page_hashes_array
from gcache.worker.config import ModelConfig
from gcache.worker.integrity import IntegrityError
from gcache.worker.kvcache.tiers.host_cache import HostCache
from gcache.worker.kvcache.tiers.host_pool import HostKVPool
from tests.support.tiny_model import ONE_FULL_LAYER, TINY_MODEL

CFG_KW = dict(TINY_MODEL, dtype="float64", layer_pattern=ONE_FULL_LAYER)
CFG = ModelConfig(**CFG_KW)


# ---- page-hash chains -----------------------------------------------------------------------
def chain_by_hand(tokens: list[int], page_size: int, prior: str | None) -> list[str]:
    """SGLang's definition, spelled out: sha256(prior digest || page tokens as u32 LE)."""
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size]))
        prior = h.hexdigest()
        out.append(prior)
    return out


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, TOKEN_ID_MAX), max_size=70),
    page_size=st.integers(1, 9),
    prior=st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex)),
    dtype=st.sampled_from(["int64", "uint32", "uint64"]),
)
def test_page_hashes_array_equals_page_hashes(tokens, page_size, prior, dtype):
    want = chain_by_hand(tokens, page_size, prior)
    assert page_hashes(tokens, page_size, prior) == want
    assert page_hashes_array(np.asarray(tokens, dtype=dtype), page_size, prior) == want
    if want:
        assert want[0] == get_hash_str(tokens[:page_size], prior)


def test_page_hashes_array_resumes_a_chain_in_pieces():
    tokens = np.random.default_rng(0).integers(0, 1 << 20, size=64)
    whole = page_hashes_array(tokens, 8)
    assert page_hashes_array(tokens[24:], 8, prior_hash=whole[2]) == whole[3:]


# ---- window-safe ends -----------------------------------------------------------------------
def safe_end_oracle(start: int, n: int, swa: list[bool], ps: int, window: int) -> int:
    """Brute force from the definition: the largest E in [start, start + n] such that every
    page overlapping the W tokens before E*ps, at or after page `start`, has SWA (E = start
    always qualifies: a lower tier already covers it)."""
    best = start
    for end in range(start + 1, start + n + 1):
        lo_token = max(0, end * ps - window)
        needed = [p for p in range(start, end) if (p + 1) * ps > lo_token]
        if all(swa[p - start] for p in needed):
            best = end
    return best


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 12), swa=st.lists(st.booleans(), max_size=24), ps=st.integers(1, 9), window=st.integers(1, 40)
)
def test_last_safe_end_matches_brute_force(start, swa, ps, window):
    got = last_safe_end(start, len(swa), lambda i: swa[i - start], ps, window)
    assert got == safe_end_oracle(start, len(swa), swa, ps, window)


@given(end=st.integers(0, 60), ps=st.integers(1, 9), window=st.integers(1, 40))
def test_tail_start_page_is_the_first_page_the_window_touches(end, ps, window):
    touched = [p for p in range(end) if (p + 1) * ps > end * ps - window]
    assert tail_start_page(end, ps, window) == (touched[0] if touched else 0)


# ---- the L2 index -----------------------------------------------------------------------------
def host_cache(full: int = 4, swa: int = 2, honor_pins: bool = True) -> HostCache:
    return HostCache(HostKVPool(CFG, full, swa, xp=np), honor_pins=honor_pins)


def put(cache: HostCache, key: str, with_swa: bool = False) -> bool:
    full = cache.reserve(AttentionKind.FULL, 1)
    swa = cache.reserve(AttentionKind.SWA, 1) if with_swa else None
    assert full is not None and (swa is not None or not with_swa)
    return cache.publish(key, full[0], swa[0] if swa else None, origin="l1")


def test_a_pinned_page_is_never_evicted():
    cache = host_cache(full=4)
    for k in "abcd":
        put(cache, k)
    assert cache.pin(["a", "b", "zz"]) == ["a", "b"]  # absent keys are not pinned
    put(cache, "e")  # evicts the oldest unpinned page: c
    assert [k in cache for k in "abcde"] == [True, True, False, True, True]
    assert cache.reserve(AttentionKind.FULL, 3) is None  # pinned a and b leave too little room
    assert [k in cache for k in "abde"] == [True, True, False, False]  # its evictions stand
    assert cache.stats["reserve_failures"] == 1
    cache.unpin(["a", "b"])
    assert cache.reserve(AttentionKind.FULL, 3) is not None  # now they may go, oldest first
    assert "a" not in cache and "b" in cache
    cache.check_integrity()


def test_without_honor_pins_a_pinned_page_is_evicted():
    """The switch failure mode 1's regression test turns off: it really changes the outcome."""
    cache = host_cache(full=2, honor_pins=False)
    put(cache, "a")
    put(cache, "b")
    cache.pin(["a", "b"])
    put(cache, "c")
    assert "a" not in cache


def test_publish_of_a_duplicate_frees_the_slot():
    cache = host_cache(full=4, swa=2)
    put(cache, "a")
    used = cache.used_pages()
    assert put(cache, "a")  # a second copy of a page L2 already has
    assert cache.used_pages() == used
    assert put(cache, "a", with_swa=True)  # its SWA is new: kept
    assert cache.get("a").swa is not None and cache.used_pages() == (used[0], used[1] + 1)
    assert put(cache, "a", with_swa=True)  # both duplicate now
    assert cache.used_pages() == (used[0], used[1] + 1)
    swa = cache.reserve(AttentionKind.SWA, 1)
    assert not cache.publish("orphan", None, swa[0], origin="l3")  # SWA with no full page: dropped
    assert cache.used_pages() == (used[0], used[1] + 1)
    cache.check_integrity()


def test_reserved_slots_belong_to_no_entry_until_published():
    cache = host_cache(full=2)
    slots = cache.reserve(AttentionKind.FULL, 2)
    cache.check_integrity()
    assert cache.reserve(AttentionKind.FULL, 1) is None  # reserved slots are not evictable
    cache.cancel(AttentionKind.FULL, slots)
    assert cache.used_pages() == (0, 0)
    cache.check_integrity()


def test_claim_for_l3_pins_until_finished():
    cache = host_cache(full=2)
    put(cache, "a")
    put(cache, "b")
    claimed = cache.claim_for_l3(["a", "b", "x"])
    assert [k for k, _, _ in claimed] == ["a", "b"]
    assert cache.claim_for_l3(["a"]) == []  # queued once
    assert cache.reserve(AttentionKind.FULL, 1) is None  # pinned while the write is pending
    cache.finish_l3(["a", "b"], stored=True)
    assert cache.pins() == {} and cache.get("a").in_l3
    assert cache.claim_for_l3(["a"]) == []  # already in L3
    cache.check_integrity(expect_unpinned=True)


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "put_swa", "pin", "unpin", "reserve_cancel"]), st.integers(0, 7)), max_size=60
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_random_operations_keep_pinned_pages_and_integrity(ops):
    cache = host_cache(full=4, swa=2)
    pins: dict[str, int] = {}
    for op, i in ops:
        key = f"k{i}"
        if op in ("put", "put_swa"):
            full = cache.reserve(AttentionKind.FULL, 1)
            swa = cache.reserve(AttentionKind.SWA, 1) if op == "put_swa" else None
            if full is None:  # only when every full slot holds a pinned page
                if swa:
                    cache.cancel(AttentionKind.SWA, swa)
                assert sum(1 for n in pins.values() if n) == 4
            else:
                cache.publish(key, full[0], swa[0] if swa else None, origin="l1")
        elif op == "pin":
            for k in cache.pin([key]):
                pins[k] = pins.get(k, 0) + 1
        elif op == "unpin" and pins.get(key):
            cache.unpin([key])
            pins[key] -= 1
        elif op == "reserve_cancel":
            got = cache.reserve(AttentionKind.SWA, 1)
            if got is not None:
                cache.cancel(AttentionKind.SWA, got)
        for k, n in pins.items():
            if n:
                assert k in cache and cache.get(k).pins == n, f"pinned page {k} was evicted"
        cache.check_integrity()


@pytest.mark.parametrize("corrupt", ["shared_slot", "leaked_slot", "negative_pins", "still_pinned"])
def test_check_integrity_raises_on_corruption(corrupt):
    cache = host_cache(full=4)
    put(cache, "a")
    put(cache, "b")
    if corrupt == "shared_slot":
        cache.entries["b"].full = cache.entries["a"].full
    elif corrupt == "leaked_slot":
        cache.pool.pools[AttentionKind.FULL].alloc(1)
    elif corrupt == "negative_pins":
        cache.entries["a"].pins = -1
    else:
        cache.pin(["a"])
    with pytest.raises(IntegrityError):
        cache.check_integrity(expect_unpinned=True)


@pytest.mark.process
def test_check_integrity_raises_under_python_O():
    """IntegrityError is raised by require(), not assert: `python -O` keeps the check."""
    code = (
        "import numpy as np\n"
        "from gcache.common.attention import AttentionKind\n"
        "from gcache.worker.kvcache.tiers.host_cache import HostCache\n"
        "from gcache.worker.kvcache.tiers.host_pool import HostKVPool\n"
        "from gcache.worker.integrity import IntegrityError\n"
        "from gcache.worker.config import ModelConfig\n"
        f"cfg = ModelConfig(**{CFG_KW!r})\n"
        "c = HostCache(HostKVPool(cfg, 2, 1, xp=np))\n"
        "c.pool.pools[AttentionKind.FULL].alloc(1)\n"
        "assert False, 'asserts must be off'\n"
        "try:\n"
        "    c.check_integrity()\n"
        "except IntegrityError as e:\n"
        "    print('raised:', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised: host full pool: 1 leaked slots")
