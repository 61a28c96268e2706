"""The one polling helper of the tests."""

from __future__ import annotations

import time

WAIT_S = 10.0
STEP_S = 0.02


def wait_until(predicate, what: str = "the condition", timeout_s: float = WAIT_S, step_s: float = STEP_S):
    """Polls `predicate` every `step_s` until it returns something truthy, and returns that;
    raises AssertionError naming `what` if it has not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(step_s)
