"""An adapter's cumulative counters in a small JSON file, for a harness that must read them
exactly (a soak reconciling them with the node's) rather than from an engine's periodic,
lagging stats log.

The file is rewritten whole every `interval_s` by a thread of its own and once more at close;
each write goes to a temporary file renamed over the old one, so a reader sees a whole file,
never a torn one. It holds {"pid", "seq", "written_at", "counters"}: `seq` counts the writes.
A failed write is logged once and retried at the next interval; it never reaches the engine.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

CLOSE_JOIN_S = 5.0


class StatsFile:
    def __init__(self, path: Path, read: Callable[[], dict[str, float]], interval_s: float, log: logging.Logger):
        self.path = path
        self._read = read
        self._interval_s = interval_s
        self._log = log
        self._seq = 0
        self._write_lock = threading.Lock()
        self._warned = False
        self._stop = threading.Event()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._loop, name="gcache-stats-file", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.write()

    def write(self) -> bool:
        """Writes the counters now; False (logged once) when the file could not be written."""
        with self._write_lock:
            self._seq += 1
            record = dict(pid=os.getpid(), seq=self._seq, written_at=time.time(), counters=self._read())
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(record))
                os.replace(tmp, self.path)
            except OSError as exc:
                if not self._warned:
                    self._log.warning("GCache: cannot write the stats file %s: %s", self.path, exc)
                    self._warned = True
                return False
        return True

    def close(self) -> None:
        """The last write, after the thread stopped."""
        self._stop.set()
        self._thread.join(CLOSE_JOIN_S)
        self.write()
