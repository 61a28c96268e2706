"""The front half of every POST, shared by worker and router: the body under its deadline
and size limit, the JSON, the endpoint's parse, and only then an in-flight slot, so a
client that stalls or sends garbage never holds one."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import typedefs as web_typedefs
from aiohttp import web

from gcache.serving.body import answer_for, expect_handler, read_body
from gcache.serving.counters import HTTPCounters
from gcache.serving.errors import HTTPError, error_response, from_http_error
from gcache.serving.limiter import InFlightLimiter
from gcache.serving.openai_api import CHAT_PATH, COMPLETIONS_PATH
from gcache.serving.safe_json import parse_json

Handler = Callable[[bytes, Any], Awaitable[web.StreamResponse]]


async def serve_post(
    request: web.Request,
    parse: Callable[[Any], Any],
    handle: Handler,
    *,
    limiter: InFlightLimiter,
    counters: HTTPCounters,
    body_bytes_max: int,
    body_timeout_s: float,
) -> web.StreamResponse:
    """Read and parse the body, take a slot, `await handle(body, parse(json))`, free the slot.
    Bad bodies get their 4xx, a full limiter a 503; `parse` raises HTTPError for a 400."""
    try:
        body = await read_body(request, body_bytes_max, body_timeout_s)
    except HTTPError as e:
        if e.status == 408:
            counters.inc("http_body_timeouts_total")
        return await answer_for(request, e)
    try:
        parsed = parse(parse_json(body))
    except HTTPError as e:
        return from_http_error(e)
    if not limiter.try_acquire():
        counters.inc("http_rejected_in_flight_total")
        return error_response(503, f"too many requests in flight (limit {limiter.limit}); retry later")
    try:
        return await handle(body, parsed)
    finally:
        limiter.release()


def openai_app(
    counters: HTTPCounters,
    log: logging.Logger,
    body_bytes_max: int,
    completions: web_typedefs.Handler,
    chat: web_typedefs.Handler,
    health: web_typedefs.Handler,
    metrics: web_typedefs.Handler,
) -> web.Application:
    """The routes worker and router both serve, behind the counting middleware; an oversized
    `Expect: 100-continue` body gets its 413 before it is sent."""
    app = web.Application(middlewares=[counters.middleware(log)], client_max_size=body_bytes_max)
    expect = expect_handler(body_bytes_max)
    app.router.add_post(COMPLETIONS_PATH, completions, expect_handler=expect)
    app.router.add_post(CHAT_PATH, chat, expect_handler=expect)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
