"""Active failover: reasons for a node to ask the master to drain it.

The cluster agent calls `check()` before every heartbeat and sends the answer
as the heartbeat's `degraded` field; the master starts a drain of an active
node that reports one. Triggers, in order:

  operator    POST /drain on the admin port (`request`), or the file DATA_DIR/DRAIN.
  disk        the native counter `disk_errors` (failed segment write / read /
              fsync / unlink, warm-list write) rises, or `checksum_failures`
              (records read back from disk whose checksum does not match) rises by
              CHECKSUM_FAILURES_DRAIN_MIN since the process started.
  memory      with --memory-pressure-drain F > 0: more than F of the puts in the
              last MEMORY_PRESSURE_WINDOW_S were refused NO_SPACE (at least
              MEMORY_PRESSURE_PUTS_MIN puts in the window, so a few refusals on
              an idle node do not count).

Once a reason is found it sticks for the life of the process (a drain is not
undone) and is logged once.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("gcache.server.degradation")

DRAIN_FILE = "DRAIN"
CHECKSUM_FAILURES_DRAIN_MIN = 4
MEMORY_PRESSURE_WINDOW_S = 60.0
MEMORY_PRESSURE_PUTS_MIN = 100
SAMPLES_MAX = 4096  # bounds the window's history whatever the check rate


class DegradationMonitor:
    """Answers "should this node drain itself, and why?" from stats and the data dir."""

    def __init__(
        self,
        stats: Callable[[], dict],
        data_dir: str | None,
        memory_pressure_fraction: float = 0.0,
        window_s: float = MEMORY_PRESSURE_WINDOW_S,
    ):
        self._stats = stats
        self._drain_file = os.path.join(data_dir, DRAIN_FILE) if data_dir else None
        self._fraction = memory_pressure_fraction
        self._window_s = window_s
        self._lock = threading.Lock()
        self._reason = ""
        self._baseline: dict | None = None
        self._samples: collections.deque = collections.deque(maxlen=SAMPLES_MAX)

    @property
    def reason(self) -> str:
        return self._reason

    def request(self, reason: str) -> str:
        """Operator request (POST /drain); returns the reason now in force."""
        self._set(reason or "operator request")
        return self._reason

    def check(self) -> str:
        """The reason to drain, or "" while the node is healthy."""
        if not self._reason:
            reason = self._file_reason() or self._stats_reason()
            if reason:
                self._set(reason)
        return self._reason

    def _set(self, reason: str) -> None:
        with self._lock:
            if self._reason:
                return
            self._reason = reason
        log.warning("asking the master to drain this node: %s", reason)

    def _file_reason(self) -> str:
        if self._drain_file and os.path.exists(self._drain_file):
            return f"operator: {self._drain_file} exists (remove it before restarting to rejoin)"
        return ""

    def _stats_reason(self) -> str:
        try:
            counters = self._stats().get("counters", {})
        except Exception as e:  # noqa: BLE001 -- a stats hiccup is not a reason to drain
            log.debug("stats unavailable for the degradation check: %s", e)
            return ""
        if self._baseline is None:
            self._baseline = dict(counters)
        disk_errors = counters.get("disk_errors", 0) - self._baseline.get("disk_errors", 0)
        if disk_errors > 0:
            return f"disk: {disk_errors} disk I/O error(s) since start (counter disk_errors)"
        bad = counters.get("checksum_failures", 0) - self._baseline.get("checksum_failures", 0)
        if bad >= CHECKSUM_FAILURES_DRAIN_MIN:
            return f"disk: {bad} record(s) read back with a bad checksum since start"
        return self._memory_reason(counters)

    def _memory_reason(self, counters: dict) -> str:
        if self._fraction <= 0:
            return ""
        now = time.monotonic()
        refused = counters.get("puts_no_space", 0)
        puts = refused + counters.get("puts_stored", 0) + counters.get("puts_exists", 0)
        self._samples.append((now, puts, refused))
        while self._samples and now - self._samples[0][0] > self._window_s:
            self._samples.popleft()
        _, puts0, refused0 = self._samples[0]
        window_puts, window_refused = puts - puts0, refused - refused0
        if window_puts >= MEMORY_PRESSURE_PUTS_MIN and window_refused > self._fraction * window_puts:
            return (
                f"memory pressure: {window_refused} of {window_puts} puts refused for lack of "
                f"space over {self._window_s:g}s (--memory-pressure-drain {self._fraction:g})"
            )
        return ""
