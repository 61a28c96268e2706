"""Start and stop a local gcache-server subprocess (for gcache-bench and gcache-demo)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """One gcache-server on a free loopback port; its output goes to `data_dir`/../server.log."""

    def __init__(self, data_dir: Path, memory: str = "1GiB", disk: str = "2GiB", extra_args=()):
        self.data_dir = Path(data_dir)
        self.memory = memory
        self.disk = disk
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.log_path = self.data_dir.parent / f"gcache-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "LocalServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "gcache.server.main", "--host", "127.0.0.1", "--port", str(self.port),
                "--admin-port", "0", "--memory", self.memory, "--disk", self.disk,
                "--data-dir", str(self.data_dir), *self.extra_args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gcache-server exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"gcache-server did not listen within {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Sends `sig`, waits, returns the exit code (SIGKILL after STOP_TIMEOUT_S)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(STOP_TIMEOUT_S)
        self._log.close()
        return code
