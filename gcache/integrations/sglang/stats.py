"""What the backend counts, and `get_stats()` in the shape SGLang's controller logs.

SGLang's HiCache logs `storage_backend.get_stats()` as a StorageMetrics
(observability/metrics_collector.py): pages per prefetch / backup batch and their
bandwidth in GB/s, drained at every read. Its module pulls in SGLang's whole
server stack, so outside a running SGLang a dataclass of the same fields stands in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

SAMPLES_MAX = 4096  # per list between two get_stats() calls; older samples are dropped
GIB = float(1 << 30)


@dataclass
class StorageMetricsShape:
    """The fields of sglang's StorageMetrics, for when that class cannot be imported."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _metrics_class() -> type:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        cls: type = StorageMetrics
        return cls
    except Exception:  # not inside a full SGLang install: any import failure counts
        return StorageMetricsShape


class BackendStats:
    """Thread-safe counters (always on) plus SGLang's batch samples (when metrics are on)."""

    COUNTERS = (
        "pages_read",
        "pages_missed",
        "pages_written",
        "entries_skipped_existing",
        "pages_write_failed",
        "exists_calls",
        "store_errors",
        "calls_while_suspect",
    )

    def __init__(self, samples_enabled: bool) -> None:
        self.samples_enabled = samples_enabled
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self._samples = StorageMetricsShape()
        self._metrics_cls: type | None = None

    def count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self.counters[name] += k

    def sample(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """kind: "prefetch" or "backup"; one batch of `pages` pages moved in `seconds`."""
        if not self.samples_enabled or pages <= 0:
            return
        with self._lock:
            pgs = getattr(self._samples, f"{kind}_pgs")
            bandwidth = getattr(self._samples, f"{kind}_bandwidth")
            if len(pgs) >= SAMPLES_MAX:  # nobody drains: keep the newest
                del pgs[0], bandwidth[0]
            pgs.append(pages)
            bandwidth.append(nbytes / GIB / max(seconds, 1e-9))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def drain_metrics(self) -> Any:
        """SGLang's StorageMetrics with the samples since the last call (then cleared)."""
        if self._metrics_cls is None:
            self._metrics_cls = _metrics_class()
        metrics = self._metrics_cls()
        with self._lock:
            for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
                samples = getattr(self._samples, name)
                getattr(metrics, name).extend(samples)
                samples.clear()
        return metrics
