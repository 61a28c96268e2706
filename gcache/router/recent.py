"""What this router just sent where: the resume points a worker will have before it
publishes them (the publish + refresh lag is a few hundred ms; a chat's next turn often
comes sooner).

A worker that ran a prompt keeps a checkpoint at the prompt's last whole page (a request
end is always one), so a later prompt that starts with all of those pages can resume
there. Only that end is credited, never a point inside it: a prefix cut mid-way is not
window-safe unless the worker says so. Entries expire after ttl_s (router clock) and are
capped per worker; the published view wins whenever it credits more.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RecentPrompts:
    def __init__(self, ttl_s: float, max_per_worker: int) -> None:
        self.ttl_s, self.max_per_worker = ttl_s, max_per_worker
        self._by_url: dict[str, OrderedDict[int, tuple[int, float]]] = {}  # last page id -> (pages, expiry)

    def record(self, url: str, ids: Sequence[int], now: float) -> None:
        if not ids or self.ttl_s <= 0:
            return
        ends = self._by_url.setdefault(url, OrderedDict())
        ends[ids[-1]] = (len(ids), now + self.ttl_s)
        ends.move_to_end(ids[-1])
        while len(ends) > self.max_per_worker:
            ends.popitem(last=False)

    def credit(self, url: str, ids: Sequence[int], limit: int, now: float) -> int:
        """Pages of `ids` (at most limit) the worker can resume at by what was sent to it."""
        ends = self._by_url.get(url)
        if not ends:
            return 0
        for i in range(min(limit, len(ids)) - 1, -1, -1):
            hit = ends.get(ids[i])
            if hit is not None and hit[0] == i + 1 and hit[1] > now:
                return i + 1
        return 0

    def forget(self, url: str) -> None:
        self._by_url.pop(url, None)
