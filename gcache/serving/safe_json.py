"""JSON request bodies parsed without surprises: every failure is an HTTPError(400).

json.loads lets through what later code crashes on, or crashes itself:
  * invalid UTF-8                       -> 400 (checked before parsing);
  * lone surrogates ("ab\\ud800cd")      -> 400 (the string cannot be encoded again);
  * nesting deeper than `depth_max`     -> 400 (json.loads' own RecursionError as well);
  * NaN / Infinity                      -> 400 (not JSON).
The walk that checks depth and strings runs only when the raw text could hold a problem
(more brackets than depth_max, or a \\uD8xx-\\uDFxx escape), so a prompt of a million
token ids is not walked.
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from gcache.serving.errors import HTTPError

DEPTH_MAX = 32
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes, depth_max: int = DEPTH_MAX) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise HTTPError(400, f"body is not valid JSON: nested deeper than {depth_max} levels") from None
    except ValueError as e:  # JSONDecodeError is a ValueError, so is _reject_constant's
        raise HTTPError(400, f"body is not valid JSON: {e}") from None
    deep = body.count(b"[") + body.count(b"{") > depth_max
    surrogates = _SURROGATE_ESCAPE.search(body) is not None
    if deep or surrogates:
        _check(obj, depth_max, surrogates)
    return obj


def _check(obj: Any, depth_max: int, strings: bool) -> None:
    """Iterative walk (no recursion to blow): depth, and strings that are not valid Unicode."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > depth_max:
                raise HTTPError(400, f"body is not valid JSON: nested deeper than {depth_max} levels")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                if strings and isinstance(k, str):
                    _check_str(k)
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
                elif strings and isinstance(v, str):
                    _check_str(v)
        elif strings and isinstance(node, str):
            _check_str(node)


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(
            400, f"body is not valid JSON text: lone surrogate {s[e.start]!r} at index {e.start} of a string"
        ) from None
