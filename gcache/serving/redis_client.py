"""The one way workers, routers and translators open Redis: fail fast, never retry inside a call.

A dead or slow Redis must cost a router one short timeout, not a retry loop on the routing
path: the callers fall back (least load, a resync later) and try again on their own schedule.
"""

from __future__ import annotations

from typing import Any


def fail_fast_redis(url: str, timeout_s: float) -> tuple[Any, tuple[type[BaseException], ...]]:
    """(client, the errors a call to it raises when Redis is down or slow)."""
    import redis  # a dependency of gcache; imported here so modules that never talk to Redis skip it

    client = redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry_on_timeout=False,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
    )
    return client, (redis.RedisError, OSError)
