"""The backend's calls to GCache, made safe for SGLang's storage threads.

SGLang runs storage calls on its prefetch and backup threads; an exception there
can end the thread or, through the scheduler, the server. So every failure of
the store becomes an answer SGLang already handles: a miss, a False, a shorter
prefix. After a connection failure the store is "suspect" for `suspect_s`: calls
answer at once instead of each waiting out a timeout, and the first call after
that window tries the store again (that is how the backend recovers).
"""

from __future__ import annotations

import logging

from gcache import errors
from gcache.common.breaker import Breaker

log = logging.getLogger("gcache.integrations.sglang")

# Failures of the store or the path to it: the store goes suspect.
_OUTAGE = (
    errors.ConnectionError,
    errors.TimeoutError,
    errors.ProtocolError,
    errors.PoolExhaustedError,
    errors.ServerError,
    OSError,
)
# Per-key problems reported after the rest of the batch was served: keep the answers.
_PARTIAL = (errors.BufferTooSmallError, errors.ValueTooLargeError, errors.ChecksumMismatchError)


class GuardedStore:
    """A gcache Client (or ClusterClient) whose calls never raise into SGLang."""

    def __init__(self, client, suspect_s: float, stats):
        self.client = client
        self.suspect_s = suspect_s
        self.stats = stats
        self._breaker = Breaker(suspect_s)

    # -- the guard -------------------------------------------------------------

    def _call(self, what: str, fn, failed, *args):
        if self._breaker.is_suspect():
            self.stats.count("calls_while_suspect")
            return failed
        try:
            answer = fn(*args)
        except _PARTIAL as exc:
            log.warning("GCache %s: %s", what, exc)
            answer = exc.results if exc.results is not None else failed
        except _OUTAGE as exc:
            self.stats.count("store_errors")
            if self._breaker.fail():  # the first failure since the store last answered
                log.warning(
                    "GCache %s failed (%s); answering misses for %.1fs at a time until the store answers again",
                    what,
                    exc,
                    self.suspect_s,
                )
            return failed
        except errors.GCacheError as exc:  # bad arguments or a closed client: not an outage
            self.stats.count("store_errors")
            log.error("GCache %s failed: %s", what, exc)
            return failed
        if self._breaker.succeed():
            log.warning("GCache store at %s answers again", self.client.address)
        return answer

    # -- calls -----------------------------------------------------------------

    def exists_prefix(self, keys: list) -> int:
        self.stats.count("exists_calls")
        return self._call("exists", self.client.batch_exists_prefix, 0, keys)

    def exists_flags(self, keys: list) -> list:
        self.stats.count("exists_calls")
        return self._call("exists", self.client.batch_is_exist, [False] * len(keys), keys)

    def get_into(self, keys: list, buffers: list, sizes: list | None = None) -> list:
        """Per key the value's length, or None (miss or failure). buffers: addresses or views."""
        return self._call("get", self.client.batch_get_into, [None] * len(keys), keys, buffers, sizes)

    def put_from(self, keys: list, buffers: list, sizes: list | None = None) -> list:
        return self._call("put", self.client.batch_put_from, [False] * len(keys), keys, buffers, sizes)

    def remove(self, keys: list) -> bool:
        """True when every key is gone (removed now, or absent already)."""
        done = self._call("remove", self.client.batch_remove, None, keys)
        return done is not None
