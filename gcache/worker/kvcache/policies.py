"""The cache hierarchy's two policies as contracts: when pages go down (WriteRule) and how long
a waiting request waits for its L3 prefetch (PrefetchRule). TieredPrefixCache picks one of each by the
names in TieredCacheConfig (write_rule / prefetch_rule below) and asks it at fixed points; the
page moves themselves stay TieredPrefixCache's.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from gcache.worker.kvcache.tiered_config import PrefetchPolicy, TieredCacheConfig, WritePolicy


class WriteRule(ABC):
    """The write policy: which computed pages TieredPrefixCache copies from L1 down to L2 (and, from
    there, queues for L3), and when. Asked from the engine thread only."""

    policy: WritePolicy  # the name this rule answers to (TieredCacheConfig.write_policy)

    @property
    @abstractmethod
    def writes_at_insert(self) -> bool:
        """Whether prepare_write copies a request's new pages down before they enter the L1
        tree (write-through); False leaves them in L1 only until something else moves them."""

    @property
    @abstractmethod
    def writes_at_evict(self) -> bool:
        """Whether pages the L1 tree is about to evict are copied down first (write-back)."""

    @property
    @abstractmethod
    def counts_hits(self) -> bool:
        """Whether L1 hits are counted per page, a page being written once its count reaches
        write_threshold (selective)."""

    def at_insert(self, idx, keys: list[str], hits: dict) -> list[int] | range:
        """Of the page indexes idx (into keys) that writes_at_insert would write, those to
        write now; hits maps a page key to its L1 hit count. Default: all of them."""
        return idx


class WriteThrough(WriteRule):
    """write_through: every new page goes down at insert."""

    policy = WritePolicy.WRITE_THROUGH
    writes_at_insert, writes_at_evict, counts_hits = True, False, False


class WriteThroughSelective(WriteRule):
    """write_through_selective: a page goes down at insert once it has had `threshold` hits,
    and when its hit count reaches `threshold` later."""

    policy = WritePolicy.WRITE_THROUGH_SELECTIVE
    writes_at_insert, writes_at_evict, counts_hits = True, False, True

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def at_insert(self, idx, keys: list[str], hits: dict) -> list[int]:
        return [i for i in idx if hits.get(keys[i], 0) >= self.threshold]


class WriteBack(WriteRule):
    """write_back: a page goes down only when L1 evicts it."""

    policy = WritePolicy.WRITE_BACK
    writes_at_insert, writes_at_evict, counts_hits = False, True, False


class PrefetchRule(ABC):
    """The prefetch policy: whether the scheduler may admit a waiting request whose L3
    prefetch is still running (TieredPrefixCache.ready; a request without one, or whose prefetch is
    done, is always ready). Asked from the engine thread, once per candidate per step."""

    policy: PrefetchPolicy  # the name this rule answers to (TieredCacheConfig.prefetch_policy)

    @abstractmethod
    def ready(self, started_s: float) -> bool:
        """True to admit the request now with what has arrived (its prefetch started at
        time.monotonic() == started_s); False to keep it waiting this step."""


class BestEffort(PrefetchRule):
    """best_effort: never wait."""

    policy = PrefetchPolicy.BEST_EFFORT

    def ready(self, started_s: float) -> bool:
        return True


class WaitComplete(PrefetchRule):
    """wait_complete: wait until the prefetch is done (the client's timeouts bound it)."""

    policy = PrefetchPolicy.WAIT_COMPLETE

    def ready(self, started_s: float) -> bool:
        return False


class PrefetchTimeout(PrefetchRule):
    """timeout: wait until the prefetch is done or timeout_s passed since it started."""

    policy = PrefetchPolicy.TIMEOUT

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def ready(self, started_s: float) -> bool:
        return time.monotonic() - started_s >= self.timeout_s


def write_rule(config: TieredCacheConfig) -> WriteRule:
    """The WriteRule config.write_policy names."""
    policy = WritePolicy(config.write_policy)
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        return WriteThroughSelective(config.write_threshold)
    return WriteBack() if policy is WritePolicy.WRITE_BACK else WriteThrough()


def prefetch_rule(config: TieredCacheConfig) -> PrefetchRule:
    """The PrefetchRule config.prefetch_policy names."""
    policy = PrefetchPolicy(config.prefetch_policy)
    if policy is PrefetchPolicy.TIMEOUT:
        return PrefetchTimeout(config.prefetch_timeout_s)
    return BestEffort() if policy is PrefetchPolicy.BEST_EFFORT else WaitComplete()
