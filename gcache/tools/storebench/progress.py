"""A plain-text progress bar on stderr, driven by planned time per step.

The bar advances with wall time inside the current step (capped at the step's
plan) so it needs no callbacks from worker threads or other processes.
"""

from __future__ import annotations

import sys
import threading
import time

BAR_WIDTH = 30
REFRESH_S = 0.5
SHOW_ABOVE_S = 3.0  # runs planned shorter than this show no bar


class Progress:
    def __init__(self, total_s: float, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.total_s = max(total_s, 1e-9)
        self.enabled = enabled and total_s > SHOW_ABOVE_S
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._done_s = 0.0
        self._step_s = 0.0
        self._step_start = time.monotonic()
        self._label = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.enabled and self.tty:
            self._thread = threading.Thread(target=self._render_loop, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * REFRESH_S)
            self._render(final=True)

    def step(self, label: str, planned_s: float) -> None:
        """Starts the next step; the previous one counts as fully done."""
        with self._lock:
            self._done_s += self._step_s
            self._step_s = planned_s
            self._step_start = time.monotonic()
            self._label = label
        if self.enabled and not self.tty:
            self.stream.write(f"[gcache-bench] {self._fraction() * 100:3.0f}% {label}\n")
            self.stream.flush()

    def _fraction(self) -> float:
        with self._lock:
            in_step = min(time.monotonic() - self._step_start, self._step_s)
            return min(1.0, (self._done_s + in_step) / self.total_s)

    def _render(self, final: bool = False) -> None:
        fraction = 1.0 if final else self._fraction()
        filled = int(fraction * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        label = "done" if final else self._label
        self.stream.write(f"\r[{bar}] {fraction * 100:3.0f}% {label[:40]:<40}")
        if final:
            self.stream.write("\n")
        self.stream.flush()

    def _render_loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self._render()
