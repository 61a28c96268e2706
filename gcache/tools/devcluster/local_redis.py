"""Start and stop a local redis-server (for the router tests, gcache-bench and bench/)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile

from gcache.common.processes import free_port, stop_process, wait_listening

START_TIMEOUT_S = 15.0
UNIX_PREFIX = "unix:"  # an address "unix:/path" is a Unix socket


class LocalRedis:
    """A throwaway redis-server on a free loopback port and a Unix socket, no persistence (a
    restart comes back empty). It can be killed -9, paused (SIGSTOP) and restarted on its port.

    `address` is the TCP one; `local_address` the Unix socket ("unix:/path"), what a client
    on this host uses at its best; `url` the redis:// URL. With start=False, start() starts it.
    """

    def __init__(self, start: bool = True, start_timeout_s: float = START_TIMEOUT_S):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
        self.exe = exe
        self.port = free_port()
        self.start_timeout_s = start_timeout_s
        self.dir = tempfile.TemporaryDirectory(prefix="gcache-redis-")
        self.socket_path = f"{self.dir.name}/redis.sock"
        self.proc: subprocess.Popen | None = None
        if start:
            self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def local_address(self) -> str:
        return UNIX_PREFIX + self.socket_path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir.name,
                "--unixsocket",
                self.socket_path,
                "--unixsocketperm",
                "700",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_listening(self.proc, self.port, self.start_timeout_s, "redis-server")
        except RuntimeError:
            self.stop()
            raise
        return self

    def kill9(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a slow / hung Redis)."""
        if self.proc is None:  # cannot happen: started
            raise RuntimeError("invariant broken: started")
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is None:  # cannot happen: started
            raise RuntimeError("invariant broken: started")
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill9()
        self.start()

    def stop(self) -> None:
        """SIGTERM (SIGKILL if it lingers; a paused one is resumed first), then the temp dir goes."""
        if self.proc is not None:
            stop_process(self.proc)
        self.dir.cleanup()

    def close(self) -> None:
        self.kill9()  # SIGKILL ends a paused one too
        self.dir.cleanup()
