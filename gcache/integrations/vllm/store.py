"""The connector's calls to GCache, made safe for vLLM's scheduler and worker.

An exception in a connector hook ends vLLM's engine, so every store failure becomes an
answer the connector already handles: 0 leading pages, False flags, a failed read (the page
is recomputed). After a connection failure the store is "suspect" for `suspect_s`: calls
answer at once instead of each waiting out a timeout (gcache.common.breaker); the first call
after that window tries the store again.
"""

from __future__ import annotations

import logging

from gcache import errors
from gcache.common.breaker import Breaker

log = logging.getLogger("gcache.integrations.vllm")

_OUTAGE = (
    errors.ConnectionError,
    errors.TimeoutError,
    errors.ProtocolError,
    errors.PoolExhaustedError,
    errors.ServerError,
    OSError,
)
# Per-key problems reported after the rest of the batch was served (a bad checksum, a value
# of the wrong size): keep the other keys' answers.
_PARTIAL = (errors.BufferTooSmallError, errors.ValueTooLargeError, errors.ChecksumMismatchError)


class GuardedStore:
    """A gcache Client whose calls never raise."""

    def __init__(self, client, suspect_s: float, stats):
        self.client = client
        self.stats = stats
        self.suspect_s = suspect_s
        self._breaker = Breaker(suspect_s)

    def _call(self, what: str, fn, failed, *args):
        if self._breaker.is_suspect():
            self.stats.count("calls_while_suspect")
            return failed
        try:
            answer = fn(*args)
        except _PARTIAL as exc:
            log.warning("GCache %s: %s", what, exc)
            answer = exc.results if exc.results is not None else failed
            if isinstance(exc, errors.ChecksumMismatchError) and exc.keys:
                self._drop(exc.keys)
        except _OUTAGE as exc:
            self.stats.count("store_errors")
            if self._breaker.fail():
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
            log.warning("GCache store at %s answers again", getattr(self.client, "address", "?"))
        return answer

    def _drop(self, keys: list) -> None:
        # A value that fails its checksum is corrupt: remove it, so the next save of that
        # page (its key names its content) stores good bytes instead of finding it "there".
        try:
            self.client.batch_remove(keys)
            self.stats.count("corrupt_values_removed", len(keys))
        except errors.GCacheError as exc:
            log.warning("GCache: could not remove %d corrupt value(s): %s", len(keys), exc)

    def exists_prefix(self, keys: list) -> int:
        return self._call("exists", self.client.batch_exists_prefix, 0, keys) if keys else 0

    def exists_flags(self, keys: list) -> list:
        if not keys:
            return []
        return self._call("exists", self.client.batch_is_exist, [False] * len(keys), keys)

    def get_into(self, keys: list, addresses: list, sizes: list) -> list:
        """Per key the value's length, or None (a miss, a bad checksum, a failure)."""
        if not keys:
            return []
        return self._call("get", self.client.batch_get_into, [None] * len(keys), keys, addresses, sizes)

    def put_from(self, keys: list, addresses: list, sizes: list) -> list:
        if not keys:
            return []
        return self._call("put", self.client.batch_put_from, [False] * len(keys), keys, addresses, sizes)
