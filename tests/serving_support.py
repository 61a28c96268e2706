"""Real gcache-worker / gcache-router subprocesses on free loopback ports, and raw HTTP helpers."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO_ROOT
from gcache.common.processes import free_port, stop_process

TINY = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128,
        "window": 32, "page_size": 8, "vocab_size": 512, "dtype": "float64"}
WORKER_ARGS = ["--config-json", json.dumps(TINY), "--kv-budget-mib", "1", "--max-prompt-tokens", "600",
               "--max-new-tokens", "64", "--chunk-tokens", "64", "--max-tokens-per-step", "128"]
START_TIMEOUT_S = 30.0
ENV = {"GCACHE_BACKEND": "numpy", "OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def _command(script: str, module: str) -> list[str]:
    exe = shutil.which(script, path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", module]


class Proc:
    """A server subprocess; start() waits (bounded) until GET /health answers `healthy_status`."""

    name = "proc"

    def __init__(self, cmd: list[str], log_dir: Path, healthy_status: int = 200) -> None:
        self.port = free_port()
        self.cmd = cmd + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_dir / f"{self.name}-{self.port}.log"
        self.healthy_status = healthy_status
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        return self.launch().wait_ready()

    def launch(self):
        """Start the process without waiting (start several, then wait_ready() on each)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=ENV)
        return self

    def wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.log()}")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == self.healthy_status:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self.name} not healthy within {START_TIMEOUT_S}s: {self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        """SIGTERM, bounded wait (then SIGKILL); returns the exit code."""
        return stop_process(self.proc, signal.SIGTERM, 15)

    def kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL)


def start_all(procs: list) -> list:
    """Launch every process, then wait for each (startup in parallel)."""
    for p in procs:
        p.launch()
    try:
        return [p.wait_ready() for p in procs]
    except Exception:
        for p in procs:
            p.kill()
        raise


class WorkerProc(Proc):
    name = "worker"

    def __init__(self, log_dir: Path, extra=()) -> None:
        super().__init__(_command("gcache-worker", "gcache.worker.http.server") + WORKER_ARGS + list(extra), log_dir)


class RouterProc(Proc):
    name = "router"

    def __init__(self, log_dir: Path, workers: list[str] | None, extra=()) -> None:
        """workers: a static --workers list; None: give --redis in extra."""
        static = ["--workers", ",".join(workers)] if workers is not None else []
        super().__init__(_command("gcache-router", "gcache.router.main") + static + list(extra), log_dir)


# ---- raw HTTP ----------------------------------------------------------------------------------------
def request(port: int, method: str, path: str, body: bytes | None = None, headers=None, timeout: float = 60):
    """(status, body bytes, headers dict) over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def post_json(port: int, path: str, payload, timeout: float = 60):
    """(status, decoded JSON or SSE events, headers)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, raw, headers = request(port, "POST", path, body, {"Content-Type": "application/json"}, timeout)
    if headers.get("content-type", "").startswith("text/event-stream"):
        from gcache.serving.sse import parse_events
        return status, parse_events(raw), headers
    return status, json.loads(raw), headers


def read_response(sock: socket.socket, limit: int = 1 << 20) -> tuple[int, dict, bytes]:
    """Read one HTTP/1.1 response with a Content-Length from a raw socket (bounded by its timeout)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response header: {data!r}")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length and len(rest) < limit:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:length]


def metric(port: int, name: str) -> float:
    status, raw, _ = request(port, "GET", "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    for line in raw.decode().splitlines():
        if line.startswith(name + " ") or (line.startswith(name + "{") and "}" in line and line.split()[0] == name):
            return float(line.split()[-1])
    raise KeyError(name)


def openai_client(base_url: str, **kw):
    import openai
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
