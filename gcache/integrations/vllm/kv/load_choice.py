"""Sync or async, per load, from measured costs instead of a fixed token count.

A load in the step (sync) runs before the step's forward: the request is scheduled at once,
but every other request of that step waits for the load too. A load between steps (async)
leaves the others' step alone, but the request waits in WAITING_FOR_REMOTE_KVS and vLLM
picks it up one or two steps after its bytes land (vLLM 0.32 has no way to wake its loop).

So: with no other request running, in the step (nobody else waits), unless the load is so
long that requests arriving meanwhile would wait behind it (`idle_max_s`). With others
running, in the step when it adds at most `fraction` of a step to their step time; else
between steps. A load's time is its bytes at the rate measured on this engine's own loads
(from the store, or from prefetch staging: a memcpy); the step time is the engine's recent
forward steps. Pure: no vLLM, no store.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

EWMA_WEIGHT = 0.3  # the newest observation's weight
# Before the first load is measured: a conservative store read plus copy, and a staged copy.
FETCH_PRIOR_BPS = 1e9
STAGED_PRIOR_BPS = 4e9


def choose_async(load_s: float, step_s: float, others_running: bool, fraction: float, idle_max_s: float) -> bool:
    """True: load between steps; False: in the step (see the module's text)."""
    if not others_running:
        return load_s > idle_max_s
    return load_s > fraction * step_s


@dataclass
class Ewma:
    value: float
    seen: int = 0

    def observe(self, x: float) -> None:
        self.value = x if not self.seen else (1 - EWMA_WEIGHT) * self.value + EWMA_WEIGHT * x
        self.seen += 1


@dataclass
class LoadCosts:
    """What this engine's loads and steps took lately (thread-safe: the scheduler's thread
    reads, the worker's reports write)."""

    fetch_bps: Ewma = field(default_factory=lambda: Ewma(FETCH_PRIOR_BPS))
    staged_bps: Ewma = field(default_factory=lambda: Ewma(STAGED_PRIOR_BPS))
    step_s: Ewma = field(default_factory=lambda: Ewma(0.0))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_load(self, nbytes: float, seconds: float, staged: bool) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            (self.staged_bps if staged else self.fetch_bps).observe(nbytes / seconds)

    def observe_step(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self.step_s.observe(seconds)

    def load_seconds(self, nbytes: float, staged: bool) -> float:
        with self._lock:
            return nbytes / (self.staged_bps if staged else self.fetch_bps).value

    def recent_step_s(self) -> float:
        with self._lock:
            return self.step_s.value
