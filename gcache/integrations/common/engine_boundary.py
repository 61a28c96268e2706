"""Where an engine's thread calls into an adapter: one home for "never raise into the engine".

Every hook an engine calls (a connector's, a storage backend's) runs through one
`EngineBoundary`: an exception (our bug or bad input) is logged with its traceback, counted
where the adapter counts errors, and turned into the hook's "nothing happened" answer (a miss,
no pages saved), so the engine's own threads live on and recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineBoundary:
    """`boundary(what, failed, fn, *args)`: `fn(*args)`, or `failed` when it raised."""

    def __init__(self, name: str, log: logging.Logger, on_error: Callable[[], None] | None = None) -> None:
        self.name = name  # who failed, in the log line: "GCacheConnector", "GCache backend", ...
        self.log = log
        self.on_error = on_error

    def __call__(self, what: str, failed: T, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:  # our bug or bad input: the engine's threads must live on
            if self.on_error is not None:
                self.on_error()
            self.log.error("%s %s failed: %s", self.name, what, exc, exc_info=True)
            return failed
