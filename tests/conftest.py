"""Shared fixtures: real gcache-server processes on free loopback ports."""
from __future__ import annotations

import os

# One BLAS thread: on 2 shared cores, BLAS thread pools only fight each other.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One gcache-server subprocess. start() returns once its port accepts."""

    def __init__(self, data_dir: Path, memory: str = "64MiB", disk: str = "256MiB", extra_args=()):
        self.data_dir = Path(data_dir)
        self.memory = memory
        self.disk = disk
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.admin_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"server-{self.port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "ServerProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable, "-m", "gcache.server.main",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--admin-port", str(self.admin_port),
            "--memory", self.memory, "--disk", self.disk,
            "--data-dir", str(self.data_dir),
            *self.extra_args,
        ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gcache-server exited with {self.proc.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"gcache-server did not start in {timeout_s}s: {self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Sends `sig` and waits; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def server_factory(tmp_path):
    """Starts servers on demand; every one still running is killed at teardown."""
    started: list[ServerProcess] = []

    def start(name: str = "node", **kwargs) -> ServerProcess:
        server = ServerProcess(tmp_path / name, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def server(server_factory):
    """A fresh gcache-server: 64 MiB memory, 256 MiB disk, temp data dir."""
    return server_factory()


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port (skips if not installed)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed: run the README's setup command")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def pytest_configure(config):
    os.environ.setdefault("GCACHE_TEST", "1")
