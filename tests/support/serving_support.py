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
import threading
import time
from pathlib import Path

from gcache.common.processes import free_port, stop_process
from tests.support import REPO_ROOT
from tests.support.tiny_model import TINY_MODEL

TINY = {**TINY_MODEL, "dtype": "float64"}
WORKER_ARGS = [
    "--config-json",
    json.dumps(TINY),
    "--kv-budget-mib",
    "1",
    "--max-prompt-tokens",
    "600",
    "--max-new-tokens",
    "64",
    "--chunk-tokens",
    "64",
    "--max-tokens-per-step",
    "128",
]
START_TIMEOUT_S = 30.0
# PYTHONPATH: the workers run this checkout's code (a console script alone would import
# whichever gcache the venv has installed).
ENV = {"GCACHE_BACKEND": "numpy", "OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}


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


# ---- a burst of clients, and clients that stall (test_http_hardening, test_router_http) ----
GREETING = {"prompt": "A legitimate client. ", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
BURST_WAIT_S = 60.0


def burst(port: int, n: int) -> list:
    """n clients connect at once (behind a barrier) and each POSTs one completion."""
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def one(i: int) -> None:
        try:
            barrier.wait(BURST_WAIT_S)
            results[i] = post_json(port, "/v1/completions", GREETING, timeout=BURST_WAIT_S)[:2]
        except Exception as e:  # noqa: BLE001 - the test asserts none happened
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * BURST_WAIT_S)
    return results


def stalled_connections(port: int, n: int, send_body_bytes: bytes = b"") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=BURST_WAIT_S)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + send_body_bytes
        )
        socks.append(s)
    return socks
