"""What the KV-event translator (translator.Translator) and the L3 subscriber
(l3_events.L3Subscriber) share: a ZMQ stream in, Redis out, on two threads.

The subscriber thread feeds every message to receive(); the publisher thread calls flush()
every interval_s and, while it fails (Redis down) or crashes (a bug), retries at a doubling
pause capped at RETRY_MAX_S, so a Redis that comes back is caught up within half a second.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

RETRY_MAX_S = 0.5


class EventBridge(ABC):
    name: str  # in thread names and log lines
    log: logging.Logger

    def _start(self, interval_s: float, start_threads: bool) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        if start_threads:
            for target, role in ((self._sub_loop, "sub"), (self._pub_loop, "pub")):
                t = threading.Thread(target=target, name=f"{self.name}-{role}", daemon=True)
                t.start()
                self._threads.append(t)

    @abstractmethod
    def _sub_loop(self) -> None:
        """Receive until self._stop is set (gcache.router.ingest.zmq_sub.subscribe_loop)."""

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
        while not self._stop.is_set():
            try:
                ok = self.flush()
            except Exception:  # a bug, not Redis: keep publishing (else routers drop what we write)
                ok = False
                self.log.exception("%s: flush crashed; will keep retrying", self.name)
            pause = self._interval_s if ok else min(RETRY_MAX_S, max(pause, 0.05) * 2)
            self._stop.wait(pause)

    def _join(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
