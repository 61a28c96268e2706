"""Shared fixtures: real gcache-server processes on free loopback ports."""
from __future__ import annotations

import os

# One BLAS thread: on 2 shared cores, BLAS thread pools only fight each other.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import shutil
from pathlib import Path

import pytest

from gcache.tools.devcluster.local_server import LocalServer
from gcache.tools.storebench.peers.redis_peer import LocalRedis

REPO_ROOT = Path(__file__).resolve().parent.parent


class ServerProcess(LocalServer):
    """A gcache-server subprocess for tests: small tiers, an admin port, start() waits for its port."""

    def __init__(self, data_dir: Path, memory: str = "64MiB", disk: str = "256MiB", extra_args=()):
        super().__init__(data_dir, memory=memory, disk=disk, extra_args=extra_args, start_timeout_s=20.0)
        self.pick_admin_port()

    def log(self) -> str:
        return self.log_tail()


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
def redis_server():
    """A real redis-server on a free loopback port (skips if not installed)."""
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed: run the README's setup command (./setup.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI runs setup.sh, so a missing server is a broken setup
        pytest.skip(message)
    redis = LocalRedis()
    yield redis.address
    redis.stop()


def pytest_configure(config):
    os.environ.setdefault("GCACHE_TEST", "1")
