"""Thread-safe counters an adapter keeps (always on): `snapshot()` for a report, `delta()` for
an engine's stats interval (the change since the last call)."""

from __future__ import annotations

import threading


class Counters:
    def __init__(self, counters: tuple[str, ...], seconds: tuple[str, ...] = ()):
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(counters, 0)
        self._values.update(dict.fromkeys(seconds, 0.0))
        self._reported = dict(self._values)

    def count(self, name: str, k: float = 1) -> None:
        with self._lock:
            self._values[name] += k

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def delta(self) -> dict[str, float]:
        """The change since the last delta(); {} when none."""
        with self._lock:
            now = dict(self._values)
            changed = {k: now[k] - self._reported[k] for k in now if now[k] != self._reported[k]}
            self._reported = now
        return changed
