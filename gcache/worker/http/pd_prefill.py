"""The prefill side's wait for its prompt's KV to be in L3 before it hands the request over.

It asks the engine thread (EngineThread.ask_stored_in_l3: cache entries are read there only),
whose answer comes from the host cache: the L3 writer threads mark pages in_l3 when their write
is acknowledged. The wait ends when every page is there, when nothing more is queued (a dropped
write will not come: the decode worker recomputes those pages), or at the deadline; an engine
that does not answer in time counts as nothing more stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from gcache.worker.engine.messages import L3Stored
from gcache.worker.engine.scheduler import EngineStoppedError, QueueFullError

POLL_S = 0.002
ASK_TIMEOUT_S = 1.0  # one question's bound (the engine answers between steps)

Ask = Callable[[Sequence[str], int, float], Awaitable[L3Stored]]


async def wait_stored(ask: Ask, keys: list[str], swa_lo: int, timeout_s: float) -> int:
    """Pages [0, n) in L3, waiting (bounded) while writes of them are queued."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stored = 0
    while True:
        try:
            stored, queued = await ask(keys, swa_lo, max(POLL_S, min(ASK_TIMEOUT_S, deadline - loop.time())))
        except (asyncio.TimeoutError, QueueFullError, EngineStoppedError):
            queued = loop.time() < deadline  # no answer this time: ask again until the deadline
        if stored == len(keys) or not queued or loop.time() >= deadline:
            return stored
        await asyncio.sleep(POLL_S)
