"""The one Redis writer of what an engine holds: every producer's (the worker's publisher, the
vLLM translator, the L3 subscriber) writes go through it, so the keys, the transaction and the
caps are written one way (the layout is gcache.serving.redis_layout).

One write() is one MULTI: the page changes (a snapshot rewrites P:pages:<url> and marks the
stream with a resync entry; a delta updates the hash and appends its records to P:ev:<url>),
the shared L3 view's adds (l3_view), the registration with its TTL (the heartbeat), and the
discovery entry. A delta only refreshes an existing registration (SET XX): when it was gone
(Redis restarted empty, or the producer stalled past the TTL) write() returns False and the
caller writes a snapshot, so nothing points routers at a partial state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gcache.serving.announce.l3_view import queue_l3
from gcache.serving.redis_layout import Keys, encode_records, id_bytes

HSET_CHUNK = 10_000  # fields per HSET inside a snapshot transaction
WORKERS_FORGET_MS = 3_600_000  # discovery entries not refreshed for an hour are removed

# The registration's JSON for (epoch, seq, now_ms): what the producer says about itself.
RegistrationJson = Callable[[str, int, int], bytes]


class AnnounceWriter:
    """One engine's (one URL's) state in Redis, and the shared L3 view."""

    def __init__(
        self,
        redis: Any,
        keys: Keys,
        url: str,
        *,
        ttl_s: float = 3.0,
        stream_max: int = 1000,
        l3_pages_max: int = 1 << 20,
    ) -> None:
        self.redis, self.keys, self.url = redis, keys, url
        self.ttl_ms = int(ttl_s * 1000)
        self.stream_max, self.l3_pages_max = stream_max, l3_pages_max
        self.epoch, self.seq = "", 0  # of the stream, as last written

    def write(
        self,
        full: bool,
        pages: Sequence[tuple[int, int]],
        registration: RegistrationJson,
        l3_adds: Iterable[tuple[int, int]] = (),
    ) -> bool:
        """Pages (page id, flags; 0 = gone), as a snapshot (`full`) or a delta, the L3 adds and
        the registration, in one transaction. False: a delta found no registration (nothing
        was published as current; write a snapshot). Raises the client's errors."""
        k, url, now_ms = self.keys, self.url, int(time.time() * 1000)
        p = self.redis.pipeline(transaction=True)
        if full:
            epoch, seq = os.urandom(8).hex(), 0
            p.delete(k.pages(url))
            for i in range(0, len(pages), HSET_CHUNK):
                p.hset(k.pages(url), mapping={id_bytes(pid): bytes([f]) for pid, f in pages[i : i + HSET_CHUNK]})
            p.xadd(k.events(url), {"e": epoch, "s": 0, "r": 1}, maxlen=self.stream_max, approximate=True)
        else:
            epoch, seq = self.epoch, self.seq
            if pages:
                seq += 1
                sets = {id_bytes(pid): bytes([f]) for pid, f in pages if f}
                dels = [id_bytes(pid) for pid, f in pages if not f]
                if sets:
                    # redis-py types mapping as Mapping[EncodableT, EncodableT]: its invariant key
                    # type rejects a dict[bytes, bytes]
                    p.hset(k.pages(url), mapping=sets)  # type: ignore[arg-type]
                if dels:
                    p.hdel(k.pages(url), *dels)
                p.xadd(
                    k.events(url),
                    {"e": epoch, "s": seq, "d": encode_records(pages)},
                    maxlen=self.stream_max,
                    approximate=True,
                )
        queue_l3(p, k, l3_adds, (), now_ms, self.l3_pages_max)
        p.set(k.reg(url), registration(epoch, seq, now_ms), px=self.ttl_ms, xx=not full)
        p.zadd(k.workers, {url: now_ms})
        p.zremrangebyscore(k.workers, "-inf", now_ms - WORKERS_FORGET_MS)  # long-gone URLs
        results = p.execute()
        if not full and not results[-3]:
            return False
        self.epoch, self.seq = epoch, seq
        return True

    def write_l3(self, adds: Iterable[tuple[int, int]], removes: Iterable[tuple[int, int]]) -> None:
        """Only the shared L3 view's changes (the L3 subscriber: it registers no engine)."""
        p = self.redis.pipeline(transaction=True)
        if queue_l3(p, self.keys, adds, removes, int(time.time() * 1000), self.l3_pages_max):
            p.execute()

    def deregister(self) -> None:
        """Remove the engine: routers stop sending to it at once."""
        k, url = self.keys, self.url
        p = self.redis.pipeline(transaction=True)
        p.delete(k.reg(url), k.pages(url), k.events(url))
        p.zrem(k.workers, url)
        p.execute()
