"""The front half of every POST, shared by worker and router: the body under its deadline
and size limit, the JSON, the endpoint's parse, and only then an in-flight slot, so a
client that stalls or sends garbage never holds one."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from aiohttp import web

from .body import answer_for, read_body
from .counters import HTTPCounters
from .errors import HTTPError, error_response, from_http_error
from .limiter import InFlightLimiter
from .safe_json import parse_json

Handler = Callable[[bytes, Any], Awaitable[web.StreamResponse]]


async def serve_post(request: web.Request, parse: Callable[[dict], Any], handle: Handler, *,
                     limiter: InFlightLimiter, counters: HTTPCounters, body_bytes_max: int,
                     body_timeout_s: float) -> web.StreamResponse:
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
