"""The shared L3 view in Redis: how its changes are queued (the layout is in redis_layout.py).

Two producers feed it, both through writer.AnnounceWriter: a gcache-worker's publisher (its
L3 store's writes: adds only) and the router's L3-events subscriber (GCache's vLLM
connectors' KV events: adds and removals). `queue_l3` writes the keys, scores and caps one way:
  an add     ZADD P:l3 / P:l3swa (score: now, ms), ZREM from the matching :gone set;
  a removal  ZREM from P:l3 / P:l3swa, ZADD P:l3:gone / P:l3swa:gone (score: now, ms),
so a router that reads by score since its last read (router/state.py) sees both, in order.
Each set is capped (the oldest entries dropped): an index that loses an entry costs a hit,
one that keeps a removed page is bounded by the cap and the routers' own bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gcache.serving.redis_layout import L3_FULL, L3_SWA, Keys, id_bytes


def queue_l3(
    pipe: Any,
    keys: Keys,
    adds: Iterable[tuple[int, int]],
    removes: Iterable[tuple[int, int]],
    now_ms: int,
    pages_max: int,
) -> int:
    """Queue (page id, L3_FULL | L3_SWA bits) adds and removals on `pipe` (a redis-py
    pipeline); returns how many commands were queued."""
    adds, removes = list(adds), list(removes)
    n = 0
    for key, gone, bit in ((keys.l3_full, keys.l3_full_gone, L3_FULL), (keys.l3_swa, keys.l3_swa_gone, L3_SWA)):
        added = [id_bytes(pid) for pid, f in adds if f & bit]
        removed = [id_bytes(pid) for pid, f in removes if f & bit]
        if added:
            pipe.zadd(key, dict.fromkeys(added, now_ms))
            pipe.zrem(gone, *added)
            pipe.zremrangebyrank(key, 0, -(pages_max + 1))
            n += 3
        if removed:
            pipe.zrem(key, *removed)
            pipe.zadd(gone, dict.fromkeys(removed, now_ms))
            pipe.zremrangebyrank(gone, 0, -(pages_max + 1))
            n += 3
    return n
