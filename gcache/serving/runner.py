"""Run an aiohttp app on a TCP socket with a listen backlog large enough for a burst.

Python's http.server listens with a backlog of 5, so a burst of 200 connections gets
resets; here the kernel queues up to `backlog` (capped by net.core.somaxconn) and the
app answers each one (200, or 503 when its in-flight limit is reached).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

BACKLOG = 4096
KEEPALIVE_S = 75.0  # idle keep-alive connections are closed after this


async def start(
    app: web.Application,
    host: str,
    port: int,
    backlog: int = BACKLOG,
    keepalive_s: float = KEEPALIVE_S,
    shutdown_timeout_s: float = 10.0,
) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (call .cleanup() to stop) and the bound port."""
    runner = web.AppRunner(
        app, access_log=None, keepalive_timeout=keepalive_s, handle_signals=False, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=backlog, reuse_address=True)
    await site.start()
    return runner, site.port


def serve_forever(
    app: web.Application,
    host: str,
    port: int,
    on_started: Callable[[int], object] | None = None,
    before_cleanup: Callable[[], Awaitable[object]] | None = None,
    backlog: int = BACKLOG,
    shutdown_timeout_s: float = 10.0,
) -> None:
    """Serve until SIGTERM/SIGINT, then stop accepting, let handlers finish (bounded), clean up.
    on_started(port) runs once the socket listens; `await before_cleanup()` after the signal,
    before the server waits for its handlers (e.g. abort the engine's work so they answer)."""

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner, bound = await start(app, host, port, backlog, shutdown_timeout_s=shutdown_timeout_s)
        try:
            if on_started is not None:
                on_started(bound)
            await stop.wait()
            if before_cleanup is not None:
                await before_cleanup()
        finally:
            await asyncio.wait_for(runner.cleanup(), shutdown_timeout_s + 5)

    asyncio.run(run())
