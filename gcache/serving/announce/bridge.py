"""The one loop of every producer of what an engine holds: state in, Redis out.

Two modes, as Dynamo's one KvEventPublisher has both:
  direct  the producer is in-process and updates the bridge's state itself (the worker's
          publisher: its step hook); one thread, the flush loop.
  ZMQ     a subscriber thread feeds every message of an event stream to receive() (the vLLM
          translator, the L3 subscriber: gcache.router.ingest.zmq_sub); two threads.

The flush thread calls flush() every interval_s and, while it fails (Redis down) or crashes
(a bug), retries at a doubling pause capped at RETRY_MAX_S, so a Redis that comes back is
caught up within half a second. A crash is counted (`flush_crashes`) and logged once per run
of crashes (a bug that repeats every pause must not flood the log).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

RETRY_MAX_S = 0.5
PAUSE_MIN_S = 0.05  # the shortest pause after a failure (and the period of an interval of 0)


class EventBridge(ABC):
    name: str  # in thread names and log lines
    log: logging.Logger
    counters: dict[str, int]  # the subclass's counters; the bridge adds flush_crashes

    def _start(self, interval_s: float, start_threads: bool, subscribe: bool = True) -> None:
        """subscribe: ZMQ mode (a _sub_loop thread); False: direct mode."""
        self._interval_s = interval_s or PAUSE_MIN_S
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.counters.setdefault("flush_crashes", 0)
        if start_threads:
            loops = ((self._sub_loop, "sub"),) if subscribe else ()
            for target, role in (*loops, (self._pub_loop, "pub")):
                t = threading.Thread(target=target, name=f"{self.name}-{role}", daemon=True)
                t.start()
                self._threads.append(t)

    def _sub_loop(self) -> None:
        """ZMQ mode: receive until self._stop is set (gcache.router.ingest.zmq_sub.subscribe_loop)."""
        raise NotImplementedError(f"{self.name} runs in direct mode: it has no subscriber")

    @abstractmethod
    def flush(self) -> bool:
        """Write what changed to Redis; False if Redis failed."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters and gauges by name (numbers): what the router's /metrics shows."""

    @property
    @abstractmethod
    def source(self) -> str:
        """What this bridge reads (an engine's URL, the L3 endpoints): the metrics' label."""

    def metric_lines(self) -> list[str]:
        """Prometheus lines of stats(), gcache_router_<name>_<stat>{source="..."}."""
        prefix = "gcache_router_" + self.name.replace("-", "_")
        label = self.source.replace("\\", "\\\\").replace('"', '\\"')
        return [f'{prefix}_{k}{{source="{label}"}} {v}' for k, v in sorted(self.stats().items())]

    def _pub_loop(self) -> None:
        pause = self._interval_s
        crashing = False
        while not self._stop.is_set():
            try:
                ok = self.flush()
                crashing = False
            except Exception:  # a bug, not Redis: keep publishing (else routers drop what we write)
                ok = False
                self.counters["flush_crashes"] += 1
                if not crashing:
                    self.log.exception("%s: flush crashed; will keep retrying", self.name)
                crashing = True
            pause = self._interval_s if ok else min(RETRY_MAX_S, max(pause, PAUSE_MIN_S) * 2)
            self._stop.wait(pause)

    def _join(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout_s)
