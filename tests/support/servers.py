"""The tests' gcache-server: gcache.tools.devcluster's LocalServer with small tiers and an admin
port, and gcache-server run to its exit."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from gcache.tools.devcluster.local_server import LocalServer
from tests.support import REPO_ROOT


class ServerProcess(LocalServer):
    """A gcache-server subprocess for tests: small tiers, an admin port, start() waits for its port."""

    def __init__(self, data_dir: Path, memory: str = "64MiB", disk: str = "256MiB", extra_args=()):
        super().__init__(data_dir, memory=memory, disk=disk, extra_args=extra_args, start_timeout_s=20.0)
        self.pick_admin_port()

    def log(self) -> str:
        return self.log_tail()


def shm_server(data_dir: Path) -> tuple[ServerProcess, str]:
    """A started ServerProcess that also listens on a Unix socket (the shm transport's
    handshake), and that socket's path: in a new short temp folder, since a socket path must
    stay short (a pytest tmp path can pass the kernel's 108-byte limit)."""
    socket = f"{tempfile.mkdtemp(prefix='gc-node-')}/node.sock"
    return ServerProcess(data_dir, extra_args=["--unix-socket", socket]).start(), socket


def run_server_cli(*args: str, timeout_s: float = 60, check: bool = False) -> subprocess.CompletedProcess:
    """gcache-server run to its exit (bad flags, --help): its exit code, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "gcache.server.main", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=check,
    )
