"""In-flight limiter: at most `limit` requests hold a slot; the next one is refused (503), not queued."""

from __future__ import annotations


class InFlightLimiter:
    """Used from one asyncio loop only (no lock needed)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"in-flight limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.rejected = 0

    def try_acquire(self) -> bool:
        if self.in_flight >= self.limit:
            self.rejected += 1
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("InFlightLimiter.release without a matching acquire")
        self.in_flight -= 1
