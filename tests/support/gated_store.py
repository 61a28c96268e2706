"""A store with one method held at a gate: look at the state while that call is in flight."""

from __future__ import annotations

import threading
from typing import Any

GATE_WAIT_S = 60.0  # generous: outcomes, never timing, are asserted


class GatedStore:
    """Wraps `store`; calls of `method` set `started`, then wait for `gate` (open at first)."""

    def __init__(self, store: Any, method: str) -> None:
        self.store = store
        self.method = method
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name != self.method:
            return getattr(self.store, name)
        call = getattr(self.store, name)

        def gated(*args: Any) -> Any:
            self.started.set()
            assert self.gate.wait(GATE_WAIT_S)
            return call(*args)

        return gated
