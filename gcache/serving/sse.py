"""Server-sent events as OpenAI streams them: `data: <json>\n\n` lines, then `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def start(request: web.BaseRequest, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Send the 200 and the event-stream headers; the caller writes events."""
    resp = web.StreamResponse(status=200, headers={**HEADERS, **(headers or {})})
    await resp.prepare(request)
    return resp


def parse_events(raw: bytes) -> list[Any]:
    """Decode a whole event stream into its `data:` payloads (JSON objects, and "[DONE]")."""
    out = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if not data:
            continue
        payload = b"\n".join(data)
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out
