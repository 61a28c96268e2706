"""An adapter's calls to GCache, made safe for an engine's threads.

An exception in an engine's storage hook can end the thread or the engine (SGLang's prefetch
and backup threads, vLLM's scheduler and worker), so every failure of the store becomes an
answer the adapter already handles: 0 leading pages, False flags, a failed read (recomputed).
After a connection failure the store is "suspect" for `suspect_s`: calls answer at once
instead of each waiting out a timeout (gcache.common.breaker); the first call after that
window tries the store again (that is how an adapter recovers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from gcache import errors
from gcache.client.api import Client
from gcache.common.breaker import Breaker
from gcache.integrations.common.counters import Counters
from gcache.wire.worth import Worth

# Failures of the store or the path to it: the store goes suspect.
OUTAGE = (
    errors.ConnectionError,
    errors.TimeoutError,
    errors.ProtocolError,
    errors.PoolExhaustedError,
    errors.ServerError,
    OSError,
)
# Per-key problems reported after the rest of the batch was served (a bad checksum, a value
# of the wrong size): keep the other keys' answers.
PARTIAL = (errors.BufferTooSmallError, errors.ValueTooLargeError, errors.ChecksumMismatchError)

T = TypeVar("T")

# What the store was asked, per value, as the node counts it (`wire`): a put answered True was
# stored or already there (node: puts_stored + puts_exists), one answered False the node
# refused (puts_no_space, puts_too_large, checksum_failures_put); a get found (hits) or not
# (misses). "unanswered": the call failed on the way (a timeout, a lost connection): the node
# may have served those values or not. "unsent": the store was suspect, nothing was sent.
WIRE_COUNTERS = tuple(
    f"{op}_values_{outcome}"
    for op in ("put", "get")
    for outcome in ("answered_yes", "answered_no", "unanswered", "unsent")
)


class Counts(Protocol):
    """What GuardedStore counts with (an adapter's stats object)."""

    def count(self, name: str, k: int = 1) -> None: ...


class GuardedStore:
    """A gcache Client (or ClusterClient) whose calls never raise.

    stats: anything with count(name, k=1) that knows "store_errors" and
    "calls_while_suspect" (and "corrupt_values_removed" with remove_corrupt).
    remove_corrupt: a value that fails its checksum is removed from the store, so the next
    save of that page (its key names its content) stores good bytes instead of finding it
    "there".
    """

    def __init__(
        self, client: Client, suspect_s: float, stats: Counts, log: logging.Logger, remove_corrupt: bool = False
    ) -> None:
        self.client = client
        self.suspect_s = suspect_s
        self.stats = stats
        self.log = log
        self.remove_corrupt = remove_corrupt
        self._breaker = Breaker(suspect_s)
        self.wire = Counters(WIRE_COUNTERS)

    @property
    def down(self) -> bool:
        """The store failed and has not answered since (a miss now says nothing about its contents)."""
        return self._breaker.is_down()

    # -- the guard -------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., T], failed: T, *args: Any) -> T:
        return self._attempt(what, fn, failed, *args)[0]

    def _tallied(self, op: str, fn: Callable[..., list[Any]], failed: list[Any], *args: Any) -> list[Any]:
        """A put or get, counted per value in `wire` by what became of it."""
        answer, outcome = self._attempt(op, fn, failed, *args)
        n = len(failed)
        if outcome != "answered":
            self.wire.count(f"{op}_values_{outcome}", n)
            return answer
        yes = sum(1 for a in answer if a) if op == "put" else sum(1 for a in answer if a is not None)
        self.wire.count(f"{op}_values_answered_yes", yes)
        self.wire.count(f"{op}_values_answered_no", n - yes)
        return answer

    def _attempt(self, what: str, fn: Callable[..., T], failed: T, *args: Any) -> tuple[T, str]:
        """The answer, and "answered", "unanswered" (the call failed) or "unsent" (suspect)."""
        if self._breaker.is_suspect():
            self.stats.count("calls_while_suspect")
            return failed, "unsent"
        try:
            answer = fn(*args)
        except PARTIAL as exc:
            self.log.warning("GCache %s: %s", what, exc)
            # the batch's per-key answers: what fn returns when nothing goes wrong
            answer = cast(T, exc.results) if exc.results is not None else failed
            if self.remove_corrupt and isinstance(exc, errors.ChecksumMismatchError) and exc.keys:
                self._drop(exc.keys)
        except OUTAGE as exc:
            self.stats.count("store_errors")
            if self._breaker.fail():  # the first failure since the store last answered
                self.log.warning(
                    "GCache %s failed (%s); answering misses for %.1fs at a time until the store answers again",
                    what,
                    exc,
                    self.suspect_s,
                )
            return failed, "unanswered"
        except errors.GCacheError as exc:  # bad arguments or a closed client: not an outage
            self.stats.count("store_errors")
            self.log.error("GCache %s failed: %s", what, exc)
            return failed, "unanswered"
        if self._breaker.succeed():
            self.log.warning("GCache store at %s answers again", getattr(self.client, "address", "?"))
        return answer, "answered"

    def _drop(self, keys: list[bytes]) -> None:
        try:
            self.client.batch_remove(keys)
            self.stats.count("corrupt_values_removed", len(keys))
        except errors.GCacheError as exc:
            self.log.warning("GCache: could not remove %d corrupt value(s): %s", len(keys), exc)

    # -- calls -----------------------------------------------------------------

    def exists_prefix(self, keys: list[bytes]) -> int:
        return self._call("exists", self.client.batch_exists_prefix, 0, keys) if keys else 0

    def exists_flags(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        return self._call("exists", self.client.batch_is_exist, [False] * len(keys), keys)

    def get_into(self, keys: list[bytes], buffers: list[Any], sizes: list[int] | None = None) -> list[int | None]:
        """Per key the value's length, or None (a miss, a bad checksum, a failure).
        buffers: addresses or writable views."""
        if not keys:
            return []
        return self._tallied("get", self.client.batch_get_into, [None] * len(keys), keys, buffers, sizes)

    @property
    def can_scatter(self) -> bool:
        """Whether get_scatter reads straight from the store's shared memory (same host, shm)."""
        return bool(getattr(self.client, "can_scatter", False))

    def get_scatter(self, keys: list[bytes], runs: Any) -> list[int | None]:
        """As get_into, each value straight into its runs (gcache.client.scatter.ScatterRuns);
        a value that fails its checksum writes nothing."""
        if not keys:
            return []
        return self._tallied("get", self.client.batch_get_scatter, [None] * len(keys), keys, runs)

    def put_from(
        self, keys: list[bytes], buffers: list[Any], sizes: list[int] | None = None, worth: list[Worth] | None = None
    ) -> list[bool]:
        """`worth`: per key, told to the node in the PUT (gcache.wire.worth); None: not said."""
        if not keys:
            return []
        if worth is None:
            return self._tallied("put", self.client.batch_put_from, [False] * len(keys), keys, buffers, sizes)
        return self._tallied("put", self.client.batch_put_from, [False] * len(keys), keys, buffers, sizes, None, worth)

    def remove(self, keys: list[bytes]) -> bool:
        """True when every key is gone (removed now, or absent already)."""
        if not keys:
            return True
        return self._call("remove", self.client.batch_remove, None, keys) is not None
