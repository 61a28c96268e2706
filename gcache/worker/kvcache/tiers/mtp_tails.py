"""The `mtp` pool: MTP window tails of checkpoints in L1, L2 and L3 (issue 19).

A tail is one opaque blob per checkpoint (model/mtp_tail.py encodes it), stored under the
chain key of the checkpoint's last page with the pool suffix `mtp`: the same content
address as the page's full and SWA KV, so any worker of the same model finds it. Kept like
SWA KV: only checkpoint tails, O(W) per checkpoint, each tier bounded (oldest first out).

  * L1: a dict beside the tree; when the tree evicts the page a tail is keyed on, the tail
    goes down to L2 (like write_back demotion of the page itself).
  * L2: a host dict; written through at put() when the cache has L2.
  * L3: gcache-server. Written through at put(), off the engine's thread: the blob goes on
    the L3 store's bounded write queue (L3Store.submit_blob, the writer threads that carry
    KV pages); a full queue or a store marked down drops it (`l3_put_dropped`), a failed
    put is counted (`l3_put_errors`), and the tail stays in L1/L2 either way. So a tail is
    in L3 only once the queue has run it: a second worker reads it after L3Store.drain().
    Read on an L1/L2 miss synchronously: one small blob per admission, on the request's
    first forward.

Every blob carries a sha256 of its body, checked on every get in every tier: a corrupt or
missing tail is a miss (the engine then rebuilds or drafts blind), never wrong state.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from gcache.serving.tiers import Tier
from gcache.worker.integrity import require

POOL_MTP = "mtp"
DIGEST = 32  # sha256 trailer


def seal(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def unseal(blob) -> bytes | None:
    """The body of a sealed blob, None if its checksum does not match."""
    if blob is None or len(blob) <= DIGEST:
        return None
    blob = bytes(blob)
    body, digest = blob[:-DIGEST], blob[-DIGEST:]
    return body if hashlib.sha256(body).digest() == digest else None


class _Tier:
    """One tier's bounded dict of sealed blobs (oldest first out)."""

    def __init__(self, bytes_max: int) -> None:
        self.bytes_max, self.bytes = bytes_max, 0
        self.blobs: OrderedDict[str, bytes] = OrderedDict()

    def put(self, key: str, blob: bytes) -> list[tuple[str, bytes]]:
        """Store; returns what fell out to make room."""
        self.pop(key)
        if len(blob) > self.bytes_max:
            return []
        self.blobs[key] = blob
        self.bytes += len(blob)
        out = []
        while self.bytes > self.bytes_max:
            k, b = self.blobs.popitem(last=False)
            self.bytes -= len(b)
            out.append((k, b))
        return out

    def pop(self, key: str) -> bytes | None:
        b = self.blobs.pop(key, None)
        if b is not None:
            self.bytes -= len(b)
        return b

    def get(self, key: str) -> bytes | None:
        b = self.blobs.get(key)
        if b is not None:
            self.blobs.move_to_end(key)
        return b


class MTPTails:
    """The MTP tails of one worker's cache hierarchy (TieredPrefixCache.mtp)."""

    def __init__(self, l1_bytes: int, l2_bytes: int = 0, l3=None) -> None:
        self.l1 = _Tier(l1_bytes)
        self.l2 = _Tier(l2_bytes) if l2_bytes else None
        self.l3 = l3  # kvcache.tiers.l3_store.L3Store or None
        self.stats = dict.fromkeys(("puts", "bad", "l3_put_dropped", "l3_put_errors", "l3_get_errors"), 0)
        self._error_lock = threading.Lock()  # l3_put_errors is counted on the L3 writer threads
        self.stats.update({f"hits_{t.value}": 0 for t in (Tier.L1, Tier.L2, Tier.L3)})
        self.stats["misses"] = 0

    def put(self, key: str, body: bytes) -> None:
        """A checkpoint's tail into every tier the write-through reaches."""
        blob = seal(body)
        self.stats["puts"] += 1
        self._demote(self.l1.put(key, blob))
        if self.l2 is not None:
            self.l2.put(key, blob)
        if self.l3 is not None and self.l3.available():
            # queued, never blocking: L3 is best effort (the tail stays in L1/L2)
            if not self.l3.submit_blob(self._l3_key(key), blob, self._l3_put_failed):
                self.stats["l3_put_dropped"] += 1

    def _l3_put_failed(self) -> None:
        with self._error_lock:
            self.stats["l3_put_errors"] += 1

    def get(self, key: str) -> tuple[bytes, Tier] | None:
        """(body, tier it came from) or None: absent or failing its checksum everywhere."""
        for tier, store in ((Tier.L1, self.l1), (Tier.L2, self.l2)):
            if store is None:
                continue
            body = unseal(store.get(key))
            if body is not None:
                self.stats[f"hits_{tier.value}"] += 1
                return body, tier
            if key in store.blobs:  # corrupt: drop it, try the next tier
                store.pop(key)
                self.stats["bad"] += 1
        body = self._l3_get(key)
        if body is not None:
            self.stats[f"hits_{Tier.L3.value}"] += 1
            return body, Tier.L3
        self.stats["misses"] += 1
        return None

    def _l3_get(self, key: str) -> bytes | None:
        if self.l3 is None or not self.l3.available():
            return None
        try:
            blob = self.l3.client.get(self._l3_key(key))
        except Exception:  # noqa: BLE001 - a missing or unreadable tail is a miss
            self.stats["l3_get_errors"] += 1
            return None
        if blob is None:
            return None
        body = unseal(blob)
        if body is None:
            self.stats["bad"] += 1
        return body

    def _l3_key(self, key: str) -> bytes:
        return self.l3.keys.key(key, POOL_MTP)

    def _demote(self, dropped: list[tuple[str, bytes]]) -> None:
        if self.l2 is not None:
            for k, b in dropped:
                self.l2.put(k, b)

    # the tree's observer protocol (swa_tree.tree.SWARadixTree.observers): its pages leave L1
    def pages_stored(self, keys, swa_live) -> None:
        pass  # tails enter at put(), from the engine

    def pages_evicted(self, keys, full_ids, swa_ids) -> None:
        for k, f in zip(keys, full_ids):
            if f is not None:
                b = self.l1.pop(k)
                if b is not None:
                    self._demote([(k, b)])

    def check_integrity(self) -> None:
        for store in (self.l1, self.l2):
            if store is None:
                continue
            require(store.bytes == sum(len(b) for b in store.blobs.values()), "mtp tails: byte count drifted")
            require(store.bytes <= store.bytes_max, "mtp tails: over budget")
