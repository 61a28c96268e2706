"""The failure breaker: after a failure, a peer is *suspect* for `suspect_s` seconds.

While suspect, callers skip the peer (a miss, a False) instead of waiting out another
timeout; the first call after the window tries it again. One breaker holds any number of
peers by key (the cluster client keys its nodes by id; a client with a single store uses the
default key, None).

A key that failed stays *down* (fail() returns False for it) until succeed() or forget()
clears it, even after its window has passed: a user that logs "down" once per outage and
"answers again" once per recovery reads that off fail() and succeed().

Thread-safe: fail / succeed / retain take a lock; is_suspect reads without one (a dict read
is atomic under the GIL). Bounded: at most keys_max keys are held; beyond that the one whose
window ends first is dropped (it is the least suspect).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable

KEYS_MAX = 65536


class Breaker:
    def __init__(
        self, suspect_s: float, *, clock: Callable[[], float] = time.monotonic, keys_max: int = KEYS_MAX
    ) -> None:
        if suspect_s < 0:
            raise ValueError(f"suspect_s must be >= 0, got {suspect_s!r}")
        if keys_max < 1:
            raise ValueError(f"keys_max must be >= 1, got {keys_max!r}")
        self.suspect_s = suspect_s
        self.clock = clock
        self.keys_max = keys_max
        self._lock = threading.Lock()
        self._until: dict[Hashable, float] = {}  # key -> end of its suspect window (clock time)

    def fail(self, key: Hashable = None) -> bool:
        """`key` failed now: suspect until clock() + suspect_s. True when this starts an outage
        (the key was not down already)."""
        until = self.clock() + self.suspect_s
        with self._lock:
            first = key not in self._until
            if first and len(self._until) >= self.keys_max:
                del self._until[min(self._until, key=self._until.__getitem__)]
            self._until[key] = until
        return first

    def is_suspect(self, key: Hashable = None) -> bool:
        """True while `key`'s window runs: skip it."""
        until = self._until.get(key)
        return until is not None and self.clock() < until

    def is_down(self, key: Hashable = None) -> bool:
        """True from a failure of `key` until succeed(key) or forget: suspect or not."""
        return key in self._until

    def succeed(self, key: Hashable = None) -> bool:
        """`key` answered: not suspect, not down. True when it was down (the outage ended)."""
        if key not in self._until:  # the common case, without the lock
            return False
        with self._lock:
            return self._until.pop(key, None) is not None

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Forget every key not in `keys` (peers that left)."""
        keep = set(keys)
        with self._lock:
            for key in [k for k in self._until if k not in keep]:
                del self._until[key]

    def suspects(self) -> list[Hashable]:
        """The keys suspect now."""
        return [key for key in list(self._until) if self.is_suspect(key)]
