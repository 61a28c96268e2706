"""Client-visible errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

KIND_BY_STATUS = {
    400: "invalid_request_error",
    404: "not_found",
    408: "timeout",
    411: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "overloaded",
    504: "timeout",
}


class HTTPError(Exception):
    """An answer to the client: status + message (+ an OpenAI error type)."""

    def __init__(self, status: int, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or KIND_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    kind = kind or KIND_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(obj).encode(), content_type="application/json", headers=headers)


def error_response(
    status: int, message: str, kind: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return json_response(status, error_body(status, message, kind), headers)


def from_http_error(e: HTTPError, headers: dict[str, str] | None = None) -> web.Response:
    return error_response(e.status, e.message, e.kind, headers)
