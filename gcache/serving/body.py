"""Request bodies read under a deadline and a size limit, before any slot is taken.

A client that sends headers and then stalls (or trickles) costs one connection and
gets 408 after `deadline_s`; it never holds a completion slot. A body over the limit
gets 413: the handler answers without reading further and aiohttp's lingering close
reads and discards the rest (bounded by its lingering time), so the client, which is
still writing, gets to read the 413 instead of a broken pipe. A client that asks
`Expect: 100-continue` with a Content-Length over the limit gets the 413 before it
sends a byte of the body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler  # sends "100 Continue"

from gcache.serving.errors import HTTPError, error_response

BODY_BYTES_MAX = 8 << 20
BODY_DEADLINE_S = 10.0


def too_large(limit: int, size: int | None = None) -> HTTPError:
    got = f"body of {size} bytes" if size is not None else "body"
    return HTTPError(413, f"{got} exceeds the limit of {limit} bytes")


async def read_body(
    request: web.BaseRequest, limit: int = BODY_BYTES_MAX, deadline_s: float = BODY_DEADLINE_S
) -> bytes:
    """The whole body, or HTTPError 413 (over `limit`), 408 (not in within `deadline_s`),
    400 (the client closed before sending all of it)."""
    size = request.content_length
    if size is not None and size > limit:
        raise too_large(limit, size)
    try:
        return await asyncio.wait_for(_read(request, size, limit), deadline_s)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"request body not received within {deadline_s:g} s") from None
    except asyncio.IncompleteReadError as e:
        raise HTTPError(400, f"body ended after {len(e.partial)} of {size} bytes") from None


async def _read(request: web.BaseRequest, size: int | None, limit: int) -> bytes:
    if size is not None:
        return await request.content.readexactly(size) if size else b""
    chunks: list[bytes] = []
    total = 0  # chunked transfer: count as it comes, stop at the limit
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limit:
            raise too_large(limit)
        chunks.append(chunk)


def expect_handler(limit: int = BODY_BYTES_MAX) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """aiohttp expect_handler: 413 before the body is sent when Content-Length says it is too big."""

    async def handle(request: web.Request) -> web.StreamResponse | None:
        size = request.content_length
        if size is not None and size > limit and request.headers.get("Expect", "").lower() == "100-continue":
            resp = error_response(413, too_large(limit, size).message)
            resp.force_close()  # the client will not send the body: no lingering wait for it
            return resp
        await _default_expect_handler(request)  # sends "100 Continue"; answers nothing
        return None

    return handle


async def answer_for(request: web.BaseRequest, e: HTTPError) -> web.StreamResponse:
    """The response for a body error. After a 413 the connection stays, so aiohttp's
    lingering close can drain what the client is still sending. After a 408 the answer is
    sent and the connection closed at once: the client is stalled, lingering would only
    hold its socket longer (transport.close() still flushes the answer first)."""
    resp = error_response(e.status, e.message, e.kind)
    if e.status != 408:
        return resp
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()
    return resp
