"""PD tests' helpers: worker flags per role over one gcache-server, and a handoff by hand
(POST /pd/prefill, then /pd/decode) the way the router does it."""

from __future__ import annotations

from gcache.serving.handoff import PD_DECODE_PATH, PD_PREFILL_PATH
from tests.support.serving_support import WorkerProc, post_json

L2_MIB = "4"


def role_args(role: str, l3: str, extra=()) -> list[str]:
    return ["--role", role, "--l2-mib", L2_MIB, "--l3", l3, "--model-name", "pd-tiny", *extra]


def pd_worker(log_dir, role: str, l3: str, extra=()) -> WorkerProc:
    return WorkerProc(log_dir, role_args(role, l3, extra))


def prefill(port: int, path: str, request: dict):
    return post_json(port, PD_PREFILL_PATH, {"path": path, "request": request})


def decode(port: int, path: str, request: dict, handoff: dict):
    return post_json(port, PD_DECODE_PATH, {"path": path, "request": request, "handoff": handoff})


def stream_text(events: list, kind: str = "completion") -> str:
    """The text of SSE chunk dicts (role / usage chunks contribute nothing)."""
    out = []
    for e in events:
        if not isinstance(e, dict) or not e.get("choices"):
            continue
        c = e["choices"][0]
        out.append(c.get("text", "") if kind == "completion" else c.get("delta", {}).get("content", "") or "")
    return "".join(out)
