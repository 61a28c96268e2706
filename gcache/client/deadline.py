"""One deadline per client call, carried through every phase of it.

A call (get, put, exists, remove, ping, ...) gets `call_timeout_s` in all: every
wait inside it (a pooled connection, a connect, a socket wait, a retry's backoff,
a cluster client's wait for a newer map, its stale-epoch retries and its dual
read) is capped by what is left, and a call with nothing left stops. A
single-node Client then raises gcache.errors.TimeoutError; a ClusterClient
returns misses for the keys it did not finish (its nodes' failures are misses).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gcache import errors


class Deadline:
    """An instant on `clock` (time.monotonic) by which a call must be over."""

    __slots__ = ("at", "budget_s", "_clock")

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.budget_s = budget_s
        self.at = clock() + budget_s

    @classmethod
    def since(cls, started: float, budget_s: float) -> Deadline:
        """The deadline of a call that began at `started` (time.monotonic)."""
        deadline = cls(budget_s)
        deadline.at = started + budget_s
        return deadline

    def left(self) -> float:
        """Seconds left (<= 0: over)."""
        return self.at - self._clock()

    @property
    def expired(self) -> bool:
        return self.left() <= 0

    def cap(self, seconds: float) -> float:
        """`seconds`, or what is left if that is less (never below 0)."""
        return max(0.0, min(seconds, self.left()))

    def check(self, address: str | None, doing: str) -> None:
        """Raises gcache.errors.TimeoutError if nothing is left."""
        if self.left() <= 0:
            raise errors.TimeoutError(
                f"the call ran out of its {self.budget_s:g}s (call_timeout_s) while {doing}", address
            )


# The default timeout_s of both clients (ServerClient and ClusterClient).
TIMEOUT_S_DEFAULT = 5.0
CALL_TIMEOUT_S_MAX = 36_000.0


def call_timeout_for(timeout_s: float, retries: int, call_timeout_s: float | None) -> float:
    """A client's call_timeout_s: as given, or timeout_s * (retries + 1)."""
    if call_timeout_s is None:
        return timeout_s * (retries + 1)
    if isinstance(call_timeout_s, bool) or not 0 < call_timeout_s <= CALL_TIMEOUT_S_MAX:
        raise errors.InvalidArgumentError(
            f"call_timeout_s must be in (0, {CALL_TIMEOUT_S_MAX:g}], got {call_timeout_s!r}"
        )
    return float(call_timeout_s)


_current = threading.local()


def current() -> Deadline | None:
    """The deadline of the call this thread runs, if a caller set one (using)."""
    return getattr(_current, "deadline", None)


class _Using:
    """The context manager `using` returns: a plain class, since every call of every
    client enters one (a generator-based contextmanager costs a few microseconds more,
    a noticeable share of a 4 KiB GET)."""

    __slots__ = ("deadline", "previous")

    def __init__(self, deadline: Deadline | None):
        self.deadline = deadline
        self.previous: Deadline | None = None

    def __enter__(self) -> Deadline | None:
        self.previous = getattr(_current, "deadline", None)
        _current.deadline = self.deadline
        return self.deadline

    def __exit__(self, *exc_info) -> None:
        _current.deadline = self.previous


def using(deadline: Deadline | None) -> _Using:
    """Makes `deadline` the current one in this thread (a cluster client's part of a call):
    `with using(deadline): ...`."""
    return _Using(deadline)
