"""The prefill side's wait for its prompt's KV to be in L3 before it hands the request over.

Read-only over the host cache (thread-safe): the L3 writer threads mark pages in_l3 when
their write is acknowledged. The wait ends when every page is there, when nothing more is
queued (a dropped write will not come: the decode worker recomputes those pages), or at
the deadline.
"""

from __future__ import annotations

import asyncio

POLL_S = 0.002


def stored_prefix(host, keys: list[str], swa_lo: int) -> tuple[int, bool]:
    """(leading pages whose KV is in L3: full, and SWA from swa_lo on; whether any page is
    still queued for L3)."""
    stored, counting, queued = 0, True, False
    for i, k in enumerate(keys):
        e = host.get(k)
        if e is None:
            counting = False
            continue
        queued = queued or e.l3_queued
        if counting and e.in_l3 and not e.l3_queued and (i < swa_lo or e.swa is not None):
            stored += 1
        else:
            counting = False
    return stored, queued


async def wait_stored(host, keys: list[str], swa_lo: int, timeout_s: float) -> int:
    """Pages [0, n) in L3, waiting (bounded) while writes of them are queued."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stored, queued = stored_prefix(host, keys, swa_lo)
        if stored == len(keys) or not queued or loop.time() >= deadline:
            return stored
        await asyncio.sleep(POLL_S)
