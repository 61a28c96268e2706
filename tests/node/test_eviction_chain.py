"""The chain eviction policy (docs/storage.md, "Eviction"), exact on small crafted sequences.

Through the real Store (gcache._native.Store: put_batch and exists do what PUT_BATCH and
EXISTS_BATCH do in the server) with 4 KiB values, so the memory tier holds a known number
of values, no disk tier, and a fixed fresh weight (the online tuner off) unless the test is
about the tuner. What is in memory is read with Store.keys(), which touches nothing.
"""

import random

import pytest

from gcache._native import Store

PAGE = 4096
VALUE = bytes(range(256)) * 16  # 4 KiB


def store(values: int, weight: float = 1.0, **kw) -> Store:
    kw.setdefault("eviction_policy", "chain")
    return Store(values * PAGE, 0, "", eviction_fresh_weight=weight, **kw)


def held(s: Store) -> set[bytes]:
    return set(s.keys())


def put(s: Store, *keys: bytes) -> None:
    """Each key as its own put (no chain)."""
    for k in keys:
        assert s.put(k, VALUE) == Store.STORED


def chain(name: str, n: int) -> list[bytes]:
    return [b"%s%d" % (name.encode(), i) for i in range(n)]


def put_chain(s: Store, keys: list[bytes]) -> None:
    assert s.put_batch(keys, [VALUE] * len(keys)) == [Store.STORED] * len(keys)


def evictions_one_at_a_time(s: Store, new_keys: list[bytes]) -> list[bytes]:
    """Puts each new key alone and returns which key each put pushed out, in order."""
    out = []
    for k in new_keys:
        before = held(s)
        put(s, k)
        gone = before - held(s)
        assert len(gone) == 1, gone
        out.append(gone.pop())
        s.check_integrity()
    return out


def test_a_put_batch_loses_its_tail_first_then_its_deepest_values():
    s = store(4)
    put_chain(s, chain("a", 4))
    assert evictions_one_at_a_time(s, [b"x", b"y", b"z", b"w"]) == [b"a3", b"a2", b"a1", b"a0"]


def test_lru_loses_the_chain_head_first():
    s = store(4, eviction_policy="lru")
    put_chain(s, chain("a", 4))
    assert evictions_one_at_a_time(s, [b"x", b"y", b"z", b"w"]) == [b"a0", b"a1", b"a2", b"a3"]


def test_every_batch_tail_goes_before_any_other_value():
    s = store(6)
    put_chain(s, chain("a", 3))
    put_chain(s, chain("b", 3))
    # Tails first (newest tail first), then a's chain deepest first, then b's.
    assert evictions_one_at_a_time(s, [b"x%d" % i for i in range(6)]) == [b"b2", b"a2", b"a1", b"a0", b"b1", b"b0"]


def test_without_the_tail_hint_a_chain_still_goes_deepest_first():
    s = store(6, eviction_tail_hint=False)
    put_chain(s, chain("a", 3))
    put_chain(s, chain("b", 3))
    assert evictions_one_at_a_time(s, [b"x%d" % i for i in range(6)]) == [b"a2", b"a1", b"a0", b"b2", b"b1", b"b0"]


def test_a_batch_of_one_is_not_a_tail():
    s = store(3)
    put(s, b"p")
    put_chain(s, [b"solo"])
    put(s, b"q")
    assert evictions_one_at_a_time(s, [b"x", b"y"]) == [b"p", b"solo"]  # plain put order


def test_exists_uses_every_present_key_of_the_probed_chain():
    s = store(6)
    put_chain(s, chain("a", 3))  # a2 is its tail
    put_chain(s, chain("b", 3))
    present, prefix = s.exists([b"a0", b"missing", b"a1"])
    assert (present, prefix) == ([True, False, True], 1)
    # a0 and a1 were used after both batches were put (a1 too: behind the gap, but the
    # client puts the missing link next): they outlive everything else.
    assert evictions_one_at_a_time(s, [b"x%d" % i for i in range(4)]) == [b"b2", b"a2", b"b1", b"b0"]
    assert {b"a0", b"a1"} <= held(s)


@pytest.mark.parametrize("policy, first_out", [("chain", b"a3"), ("lru", b"a0")])
def test_a_probed_chain_keeps_its_head_hottest(policy, first_out):
    s = store(4, eviction_policy=policy)
    put(s, b"a0", b"a1", b"a2", b"a3")  # separate puts: a3 is the most recent
    assert s.exists([b"a0", b"a1", b"a2", b"a3"]) == ([True] * 4, 4)
    for k in (b"a0", b"a1", b"a2", b"a3"):  # chain: the GET after the probe is the same use
        assert s.get(k) == VALUE
    assert evictions_one_at_a_time(s, [b"x"]) == [first_out]


def _weight_scenario(weight: float) -> bytes:
    """a: read once, long ago; b: put after that read, never read. Who goes first?"""
    s = store(3, weight)
    put(s, b"a")
    assert s.get(b"a") == VALUE
    put(s, b"spacer")
    assert s.remove(b"spacer")
    put(s, b"b", b"c")
    return evictions_one_at_a_time(s, [b"d"])[0]


def test_fresh_weight_one_is_plain_recency():
    assert _weight_scenario(1.0) == b"a"  # a was used before b was put


def test_fresh_weight_ages_never_read_values_faster():
    # b's age (3 pages) x 4 outweighs a's (4 pages): the value nobody came back for goes.
    assert _weight_scenario(4.0) == b"b"


def test_a_key_put_again_soon_after_its_eviction_counts_as_used():
    s = store(2)
    put(s, b"a", b"b")
    assert evictions_one_at_a_time(s, [b"c"]) == [b"a"]
    before = s.stats()
    assert before["ghost_keys"] == 1
    assert evictions_one_at_a_time(s, [b"a"]) == [b"b"]  # the ghost of a: straight to used
    after = s.stats()
    assert after["ghost_keys"] == 1  # a's ghost used up, b's remembered
    assert after["memory_main_queue_bytes"] == PAGE  # a
    assert after["memory_small_queue_bytes"] == PAGE  # c


def test_gauges_split_fresh_and_used_bytes():
    s = store(8, 2.0)
    put_chain(s, chain("a", 4))
    assert s.exists(chain("a", 2)) == ([True, True], 2)
    stats = s.stats()
    assert stats["memory_small_queue_bytes"] == 2 * PAGE
    assert stats["memory_main_queue_bytes"] == 2 * PAGE
    assert stats["eviction_fresh_weight_pct"] == 200
    assert stats["eviction_tuner_epochs"] == 0  # fixed weight: no tuner


def test_evict_owned_takes_only_that_owners_coldest_values():
    s = store(8)
    assert s.put_batch([b"t1-a", b"t1-b", b"t1-c"], [VALUE] * 3, owner=1) == [Store.STORED] * 3
    assert s.put_batch([b"t2-a", b"t2-b"], [VALUE] * 2, owner=2) == [Store.STORED] * 2
    put(s, b"shared")
    assert s.evict_owned(1, 2 * PAGE) == 2 * PAGE
    assert held(s) == {b"t1-a", b"t2-a", b"t2-b", b"shared"}  # t1's tail, then its deepest
    assert s.evict_owned(3, PAGE) == 0  # no values
    assert s.evict_owned(2, 10 * PAGE) == 2 * PAGE  # all it has
    assert held(s) == {b"t1-a", b"shared"}
    s.check_integrity()
    with pytest.raises(ValueError):
        s.evict_owned(2**32 - 1, PAGE)  # "any owner" is not an owner


def test_evict_owned_is_a_no_op_under_s3fifo():
    s = store(4, eviction_policy="s3fifo")
    put(s, b"a")
    assert s.evict_owned(0, PAGE) == 0
    assert held(s) == {b"a"}


@pytest.mark.parametrize(
    "bad",
    [
        {"eviction_policy": "arc"},
        {"eviction_fresh_weight": 0.5},
        {"eviction_fresh_weight": 65},
        {"eviction_ghost_factor": -1},
        {"small_queue_fraction": 0.95},
    ],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Store(64 * PAGE, 0, "", **bad)


def _tuned(workload) -> tuple[int, float]:
    """(fresh weight the tuner settled on x100, hit fraction) for a workload on 64 values."""
    s = Store(64 * PAGE, 0, "")
    hits = asked = 0
    for keys in workload():
        _, prefix = s.exists(keys)
        got = 0
        while got < prefix and s.get(keys[got]) is not None:
            got += 1
        hits, asked = hits + got, asked + len(keys)
        if got < len(keys):
            s.put_batch(keys[got:], [VALUE] * (len(keys) - got))
    s.check_integrity()
    stats = s.stats()
    assert stats["eviction_tuner_epochs"] > 10
    return stats["eviction_fresh_weight_pct"], hits / asked


def _hot_set_among_one_offs():
    """A hot chain of 16 read every round, between rounds 300 one-off values (64 values of
    memory): the hot chain survives a round only if a never-read value ages more than
    300 / 48 times faster, so only weights 8 and up keep it."""
    hot = chain("hot", 16)
    for r in range(30):
        yield hot
        for i in range(300):
            yield [b"once-%d-%d" % (r, i)]


def _read_once_after_a_while():
    """Each value is read exactly once, 28 puts after its own, never again: a value that
    was read is dead, a fresh one is not. Recency (weight 1) keeps the fresh ones long
    enough (56 values touched in between, of 64); weight 2 already drops them first."""
    for i in range(3000):
        yield [b"v%d" % i]
        if i >= 28:
            yield [b"v%d" % (i - 28)]


def test_the_tuner_protects_a_hot_set_from_one_off_chains():
    weight_pct, hit_rate = _tuned(_hot_set_among_one_offs)
    assert weight_pct >= 800
    assert hit_rate > 0.04  # most rounds' 16 hot hits of 316: at most 29 * 16 / (30 * 316) = 0.049


def test_the_tuner_falls_back_to_recency_when_reads_do_not_repeat():
    weight_pct, hit_rate = _tuned(_read_once_after_a_while)
    assert weight_pct == 100
    assert hit_rate > 0.45  # nearly every second request (the re-read) hits


@pytest.mark.parametrize("policy", ["chain", "s3fifo", "lru"])
def test_invariants_hold_through_a_random_mix(policy, tmp_path):
    rng = random.Random(11)
    with Store(32 * PAGE, 48 * PAGE, str(tmp_path / "data"), segment_bytes=16 * PAGE, eviction_policy=policy) as s:
        for step in range(600):
            op = rng.random()
            keys = [b"k%d" % rng.randrange(120) for _ in range(rng.randrange(1, 6))]
            if op < 0.4:
                s.put_batch(
                    keys, [bytes([len(k)]) * rng.choice([1, PAGE, 3 * PAGE]) for k in keys], owner=rng.randrange(3)
                )
            elif op < 0.65:
                s.exists(keys)
            elif op < 0.9:
                for k in keys:
                    v = s.get(k)
                    assert v is None or v == bytes([len(k)]) * len(v)
            elif op < 0.95:
                s.remove(keys[0])
            else:
                s.evict_owned(rng.randrange(3), PAGE)
            s.check_integrity()
