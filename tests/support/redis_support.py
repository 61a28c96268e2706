"""A real redis-server for the tests (killable -9, pausable, restartable on its port), and a
TCP gate in front of it that cuts one side's link to Redis (a network fault)."""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import threading

import pytest

from gcache.tools.devcluster.local_redis import LocalRedis


def start_redis() -> LocalRedis:
    """A started redis-server (gcache.tools.devcluster's LocalRedis); skips the test if
    redis-server is not installed, and fails it under CI, whose setup installs it."""
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed: run the README's setup command (./setup.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return LocalRedis()


class TcpGate:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port> until shut: shut() closes every
    forwarded connection and, until open(), accepts new ones only to close them at once (the
    client sees the link drop, like a network cut). One thread, at most CONNECTIONS_MAX links."""

    CONNECTIONS_MAX = 64
    CHUNK = 1 << 16
    IO_TIMEOUT_S = 5.0

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.peer: dict[socket.socket, socket.socket] = {}
        self.lock = threading.Lock()
        self.is_shut = False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tcp-gate", daemon=True)

    def start(self) -> TcpGate:
        self.thread.start()
        return self

    def shut(self) -> None:
        with self.lock:
            self.is_shut = True
            for sock in list(self.peer):
                self._drop(sock)

    def open(self) -> None:
        with self.lock:
            self.is_shut = False

    def close(self) -> None:
        self.shut()
        self.stopping.set()
        self.thread.join(10)
        self.sel.close()
        self.listener.close()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            for key, _ in self.sel.select(timeout=0.05):
                with self.lock:
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj in self.peer:
                        self._pump(key.fileobj)

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except BlockingIOError:
            return
        if self.is_shut or len(self.peer) >= 2 * self.CONNECTIONS_MAX:
            client.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=self.IO_TIMEOUT_S)
        except OSError:
            client.close()
            return
        client.settimeout(self.IO_TIMEOUT_S)
        self.peer[client], self.peer[upstream] = upstream, client
        self.sel.register(client, selectors.EVENT_READ)
        self.sel.register(upstream, selectors.EVENT_READ)

    def _pump(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(self.CHUNK)
            if data:
                self.peer[sock].sendall(data)
                return
        except OSError:
            pass
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        """Caller holds the lock: close sock and its peer."""
        other = self.peer.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self.peer.pop(s, None)
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
