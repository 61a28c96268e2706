"""The cache hierarchy's write / prefetch rules and the scheduler's orderings, by name."""

from __future__ import annotations

import pytest

from gcache.worker.engine.scheduler import (
    ORDERINGS,
    FcfsOrder,
    Ordering,
    Scheduler,
    SchedulerConfig,
    SchedulerPolicy,
    TtftOrder,
)
from gcache.worker.kvcache.policies import (
    BestEffort,
    PrefetchRule,
    PrefetchTimeout,
    WaitComplete,
    WriteBack,
    WriteRule,
    WriteThrough,
    WriteThroughSelective,
    prefetch_rule,
    write_rule,
)
from gcache.worker.kvcache.tiered_config import PrefetchPolicy, TieredCacheConfig, WritePolicy


@pytest.mark.parametrize(
    "name, cls, at_insert, at_evict, counts",
    [
        ("write_through", WriteThrough, True, False, False),
        ("write_through_selective", WriteThroughSelective, True, False, True),
        ("write_back", WriteBack, False, True, False),
    ],
)
def test_write_rule_by_name(name, cls, at_insert, at_evict, counts):
    rule = write_rule(TieredCacheConfig(write_policy=name, write_threshold=3))
    assert isinstance(rule, cls) and isinstance(rule, WriteRule) and rule.policy == name
    assert (rule.writes_at_insert, rule.writes_at_evict, rule.counts_hits) == (at_insert, at_evict, counts)


def test_selective_writes_only_pages_at_the_threshold():
    rule = WriteThroughSelective(threshold=2)
    assert rule.at_insert(range(3), ["a", "b", "c"], {"a": 2, "b": 1, "c": 5}) == [0, 2]
    assert list(WriteThrough().at_insert(range(1, 3), ["a", "b", "c"], {})) == [1, 2]


def test_prefetch_rule_by_name():
    assert isinstance(prefetch_rule(TieredCacheConfig(prefetch_policy="best_effort")), BestEffort)
    assert isinstance(prefetch_rule(TieredCacheConfig(prefetch_policy="wait_complete")), WaitComplete)
    timeout = prefetch_rule(TieredCacheConfig(prefetch_policy="timeout", prefetch_timeout_s=60))
    assert isinstance(timeout, PrefetchTimeout) and isinstance(timeout, PrefetchRule)
    assert timeout.timeout_s == 60 and timeout.policy == PrefetchPolicy.TIMEOUT
    assert BestEffort().ready(0.0) and not WaitComplete().ready(0.0)
    assert PrefetchTimeout(1.0).ready(0.0) and not timeout.ready(float("inf"))


def test_policy_names_are_the_strings():
    assert tuple(WritePolicy) == ("write_through", "write_through_selective", "write_back")
    assert tuple(PrefetchPolicy) == ("best_effort", "wait_complete", "timeout")
    assert tuple(SchedulerPolicy) == ("ttft", "fcfs")


@pytest.mark.parametrize("name, cls", [("ttft", TtftOrder), ("fcfs", FcfsOrder)])
def test_scheduler_ordering_by_name(name, cls):
    sched = Scheduler(SchedulerConfig(policy=name), lambda r: r.num_tokens)
    assert isinstance(sched.ordering, cls) and isinstance(sched.ordering, Ordering)
    assert ORDERINGS[name] is cls
