"""Cost-aware eviction (eviction/worth.h): values put with a "worth" (kind + recompute
cost) are weighed by cost per byte; values without one keep the policy's order.

Through the real Store (gcache._native.Store; put_batch's `worth` is what PUT_BATCH's
"worth" field sets in the server) with 4 KiB values and no disk tier; what is in memory is
read with Store.keys(), which touches nothing.
"""

import pytest

from gcache._native import Store
from gcache.wire.worth import ValueKind

PAGE = 4096
VALUE = bytes(range(256)) * 16
STATE, ATTN = int(ValueKind.STATE_CHECKPOINT), int(ValueKind.ATTENTION_PAGE)
POLICIES = ["chain", "lru", "s3fifo"]


def store(values: int, policy: str) -> Store:
    return Store(values * PAGE, 0, "", eviction_policy=policy)


def pages(s: Store, n: int, worth: bool, name: str = "page", cost: int = 16) -> list[bytes]:
    """n pages, each its own put (by default cheap: a page spares one 16-token block)."""
    keys = [b"%s%d" % (name.encode(), i) for i in range(n)]
    for k in keys:
        assert s.put_batch([k], [VALUE], worth=[(ATTN, cost)] if worth else None) == [Store.STORED]
    return keys


@pytest.mark.parametrize("policy", POLICIES)
def test_a_costly_state_outlives_cheap_pages_of_the_same_bytes(policy):
    s = store(16, policy)
    assert s.put_batch([b"state"], [VALUE], worth=[(STATE, 16 * 1000)]) == [Store.STORED]
    pages(s, 40, worth=True)  # 2.5 memories of cheap pages, all newer than the state
    s.check_integrity()
    held = set(s.keys())
    assert b"state" in held and len(held) == 16
    gauges = s.stats()
    assert gauges["memory_worth_values"] == 16
    assert gauges["memory_worth_state_bytes"] == PAGE and gauges["memory_worth_page_bytes"] == 15 * PAGE


@pytest.mark.parametrize("policy", POLICIES)
def test_without_worth_the_state_goes_first_as_before(policy):
    s = store(16, policy)
    assert s.put_batch([b"state"], [VALUE]) == [Store.STORED]
    pages(s, 40, worth=False)
    assert b"state" not in set(s.keys())
    assert s.stats()["memory_worth_values"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_values_without_worth_keep_the_policys_exact_order(policy):
    # The same sequence with the worth layer idle and without any worth said: equal
    # survivors, value for value (the layer passes every call through).
    def run(worth_of_unused: bool) -> set[bytes]:
        s = store(32, policy)
        if worth_of_unused:  # one weighed value put and removed: the layer has seen worth
            assert s.put_batch([b"gone"], [VALUE], worth=[(STATE, 5)]) == [Store.STORED]
            assert s.remove(b"gone")
        for i in range(0, 90, 3):
            s.put_batch([b"c%d-%d" % (i, j) for j in range(3)], [VALUE] * 3)
            s.exists([b"c0-0", b"c0-1", b"c%d-0" % (i // 2)])
            s.get(b"c3-1")
        s.check_integrity()
        return set(s.keys())

    assert run(False) == run(True)


def test_an_old_state_still_ages_out():
    # Weight multiplies a value's allowance, it does not pin it: enough newer cheap
    # values push even a costly state out.
    s = store(16, "chain")
    s.put_batch([b"state"], [VALUE], worth=[(STATE, 16 * 16)])  # 16x a page's cost per byte
    pages(s, 16 * 100, worth=True)
    assert b"state" not in set(s.keys())
    s.check_integrity()


def test_a_read_renews_a_weighed_value():
    s = store(16, "lru")
    s.put_batch([b"s-old", b"s-read"], [VALUE] * 2, worth=[(STATE, 64)] * 2)
    pages(s, 14, worth=True, name="a", cost=64)
    assert s.get(b"s-read") is not None
    pages(s, 14, worth=True, name="b", cost=64)  # one class throughout: plain recency
    held = set(s.keys())
    assert b"s-read" in held and b"s-old" not in held


@pytest.mark.parametrize(
    "worth, message",
    [
        ([(STATE, 5)], r"one \(kind, cost\) per key"),
        ([(9, 5), (ATTN, 1)], "unknown value kind 9"),
    ],
)
def test_a_malformed_worth_is_refused_and_stores_nothing(worth, message):
    s = store(16, "chain")
    with pytest.raises(ValueError, match=message):
        s.put_batch([b"a", b"b"], [VALUE] * 2, worth=worth)
    assert s.keys() == [] and s.stats()["puts_stored"] == 0
