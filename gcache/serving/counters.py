"""HTTP counters of one server (worker or router), rendered as Prometheus text."""

from __future__ import annotations

import collections
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gcache.serving.errors import error_response


def prometheus_response(text: str) -> web.Response:
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


class HTTPCounters:
    """Responses by (route, status) plus named counters; used from one asyncio loop."""

    def __init__(self, prefix: str, routes: tuple[str, ...], helps: dict[str, str]) -> None:
        self.prefix, self.routes, self.helps = prefix, set(routes), helps
        self.responses: collections.Counter[tuple[str, int]] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter({k: 0 for k in helps})

    def observe(self, path: str, status: int) -> None:
        self.responses[(path if path in self.routes else "other", status)] += 1

    def inc(self, name: str, by: int = 1) -> None:
        if name not in self.helps:
            raise KeyError(f"unknown counter {name!r}")
        self.counters[name] += by

    def render(self, gauges: dict[str, tuple[str, float]] | None = None) -> str:
        p = self.prefix
        lines = [
            f"# HELP {p}http_responses_total HTTP responses by route and status",
            f"# TYPE {p}http_responses_total counter",
        ]
        for (path, status), n in sorted(self.responses.items()):
            lines.append(f'{p}http_responses_total{{route="{path}",code="{status}"}} {n}')
        for name, help_ in self.helps.items():
            lines += [f"# HELP {p}{name} {help_}", f"# TYPE {p}{name} counter", f"{p}{name} {self.counters[name]}"]
        for name, (help_, value) in (gauges or {}).items():
            lines += [f"# HELP {p}{name} {help_}", f"# TYPE {p}{name} gauge", f"{p}{name} {value}"]
        return "\n".join(lines) + "\n"

    def middleware(self, log: logging.Logger) -> Middleware:
        """Counts every response; turns unknown routes into OpenAI-shaped 404/405 and an
        unexpected exception into a 500 with a message (never an empty reply)."""

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                resp = await handler(request)
            except ConnectionError:
                raise  # the client went away: aiohttp drops the connection quietly
            except web.HTTPException as e:
                if e.status in (404, 405):
                    resp = error_response(e.status, f"no such endpoint: {request.method} {request.path}", "not_found")
                else:
                    resp = error_response(e.status, e.reason or e.text or "error")
            except Exception as e:  # noqa: BLE001 - the client gets a 500 and the log the traceback
                log.exception("unhandled error on %s %s", request.method, request.path)
                resp = error_response(500, f"internal error: {type(e).__name__}: {e}")
            self.observe(request.path, resp.status)
            return resp

        return count
