"""Shared fixtures (real gcache-server and redis-server processes on free loopback ports) and
the two markers: `process` (the test starts a process or a listening server) and `cluster`
(it starts masters, i.e. a cluster; implies `process`). A test gets `process` from the fixtures
it uses (PROCESS_FIXTURES) or from a mark in its file; an unmarked test that starts a process or
listens on a socket fails (see pytest_runtest_setup below), so `pytest -m "not process"`, the
unit lane, is pure."""

from __future__ import annotations

import os

# One BLAS thread: on 2 shared cores, BLAS thread pools only fight each other.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import _posixsubprocess
import contextlib
import socket
import subprocess

import pytest

from tests.support.redis_support import start_redis
from tests.support.servers import ServerProcess

# This file's fixtures that start processes: a test using one of them, directly or through
# another fixture, is marked `process`. A test file whose own fixtures or tests start processes
# or servers says so with `pytestmark` or `@pytest.mark.process`; one that starts masters with
# `cluster`, which implies `process`.
PROCESS_FIXTURES = {"server_factory", "server", "redis_server", "redis_proc"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("cluster") or PROCESS_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.process)


class UnmarkedProcessError(AssertionError):
    pass


def _refuse(item, what):
    def refused(*args, **kwargs):
        raise UnmarkedProcessError(
            f"{item.nodeid} {what} but is not marked `process` "
            "(use a process fixture, @pytest.mark.process or pytestmark)"
        )

    return refused


_SPAWNERS = [
    (module, name)
    for module, name in (
        (os, "fork"),
        (os, "forkpty"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
        (subprocess, "_fork_exec"),
        (_posixsubprocess, "fork_exec"),
    )
    if hasattr(module, name)
]


@contextlib.contextmanager
def _no_processes(item):
    if item.get_closest_marker("process") is not None:
        yield
        return
    saved = [(module, name, getattr(module, name)) for module, name in _SPAWNERS]
    saved.append((socket.socket, "listen", socket.socket.listen))
    for module, name, _ in saved:
        setattr(module, name, _refuse(item, "listens on a socket" if name == "listen" else "starts a process"))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """The unit lane's guard: a test not marked `process` may start no process and listen on no
    socket, in its body or in any fixture it sets up (module- and session-scoped ones included)."""
    with _no_processes(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes(item):
        yield


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
    redis = start_redis()
    yield redis.address
    redis.stop()


@pytest.fixture
def redis_proc():
    """A real redis-server that can be killed -9, paused and restarted on its port."""
    r = start_redis()
    yield r
    r.close()


@pytest.fixture(params=["native", "python"])
def client_core(request, monkeypatch):
    """Runs a test once on the native client core and once on the Python reference path
    ($GCACHE_CLIENT_CORE, gcache.client.native_core), so both answer the same bytes,
    statuses, errors and misses."""
    monkeypatch.setenv("GCACHE_CLIENT_CORE", request.param)
    return request.param
