"""How much of a prompt a worker could resume from, per tier, from the router's view of it.

Window-safe (what the worker's TieredPrefixCache.match will really load): a resume point p needs full
KV for every page before p and SWA KV for the pages covering the W tokens before p (its
window tail), i.e. p is one of the worker's published checkpoints. L1 is matched from page
0; L2 extends from the L1 point exactly as the worker's cache does (`last_safe_end` over the host
pages); the shared L3 extends from there; all three through swa_window.last_safe_end. Raw
overlap (what SWA-unaware routers count) is the run of pages with full KV, SWA ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gcache.serving.redis_layout import L1_FULL, L1_SWA, L2_FULL, L2_SWA, L3_FULL, L3_SWA
from gcache.serving.swa_window import last_safe_end


@dataclass(frozen=True)
class TierMatch:
    """Pages (cumulative ends): l1 <= l2 <= l3, window-safe; raw_l1 / raw_host: SWA-unaware runs."""

    l1: int = 0
    l2: int = 0
    l3: int = 0
    raw_l1: int = 0  # pages with L1 full KV from page 0, SWA ignored
    raw_host: int = 0  # further pages with L2 full KV after raw_l1, SWA ignored


def _extend(
    ids: Sequence[int], start: int, limit: int, flags_of, full_bit: int, swa_bit: int, page_size: int, window: int
) -> int:
    """Last window-safe end reachable from `start` (a window-safe point of a tier above, or 0)
    through the run of pages with `full_bit`; SWA of the tail pages at or after start must
    have swa_bit (those before start are covered by the tier above): swa_window.last_safe_end."""
    get = flags_of.get
    full = _run(ids, start, limit, flags_of, full_bit)
    return last_safe_end(start, full, lambda i: get(ids[i], 0) & swa_bit, page_size, window)


def _run(ids: Sequence[int], start: int, limit: int, flags_of, bit: int) -> int:
    get = flags_of.get
    i = start
    while i < limit and get(ids[i], 0) & bit:
        i += 1
    return i - start


def match_worker(
    ids: Sequence[int], limit: int, flags: Mapping[int, int], l3: Mapping[int, int], page_size: int, window: int
) -> TierMatch:
    """The tier match of one worker for a prompt whose page ids are `ids`, looking at most at
    `limit` pages (the worker leaves a token to compute: (tokens - 1) // page_size)."""
    limit = min(limit, len(ids))
    m1 = _extend(ids, 0, limit, flags, L1_FULL, L1_SWA, page_size, window)
    m2 = _extend(ids, m1, limit, flags, L2_FULL, L2_SWA, page_size, window)
    m3 = _extend(ids, m2, limit, l3, L3_FULL, L3_SWA, page_size, window) if l3 else m2
    raw_l1 = _run(ids, 0, limit, flags, L1_FULL)
    raw_host = _run(ids, raw_l1, limit, flags, L2_FULL)
    return TierMatch(m1, m2, m3, raw_l1, raw_host)


def match_l3_only(ids: Sequence[int], limit: int, l3: Mapping[int, int], page_size: int, window: int) -> int:
    """Window-safe pages any worker could load from L3 alone (a worker the router knows nothing of)."""
    return _extend(ids, 0, min(limit, len(ids)), l3, L3_FULL, L3_SWA, page_size, window) if l3 else 0
