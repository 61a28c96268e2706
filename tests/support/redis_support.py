"""A real redis-server for router tests that can be killed -9 and restarted on the same port,
and a TCP gate in front of it that cuts one side's link to Redis (a network fault)."""
from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading

import pytest

from gcache.common.processes import free_port, stop_process, wait_listening

START_TIMEOUT_S = 15.0


class RedisProcess:
    """redis-server on a free loopback port, no persistence (a restart comes back empty)."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            message = "redis-server is not installed: run ./setup.sh"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        self.exe = exe
        self.port = free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="gcache-test-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.proc, self.port, START_TIMEOUT_S, "redis-server")
        return self

    def kill9(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a slow / hung Redis)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill9()
        self.start()

    def close(self) -> None:
        self.kill9()  # SIGKILL ends a paused one too
        self.dir.cleanup()


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

    def start(self) -> "TcpGate":
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
