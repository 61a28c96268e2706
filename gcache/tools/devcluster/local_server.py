"""Start and stop a local gcache-server subprocess (for gcache-bench and gcache-demo)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

from gcache.common.file_modes import make_private_dir
from gcache.common.processes import free_port, stop_process, wait_listening

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def server_command(
    *, host: str, port: int, admin_port: int, memory: str, disk: str, data_dir, admin_host: str | None = None, extra=()
) -> list[str]:
    """The gcache-server command line of every launcher here (LocalServer, LocalCluster's nodes)."""
    admin = ["--admin-host", admin_host] if admin_host else []
    return [
        sys.executable,
        "-m",
        "gcache.server.main",
        "--host",
        host,
        "--port",
        str(port),
        *admin,
        "--admin-port",
        str(admin_port),
        "--memory",
        memory,
        "--disk",
        disk,
        "--data-dir",
        str(data_dir),
        *extra,
    ]


def node_args(*, masters: str, node_id: str, heartbeat_interval_s: float, advertise: str = "") -> list[str]:
    """The flags that make a gcache-server a cluster node: its masters, its id, the address it
    advertises ("": the server's default, host:port)."""
    return [
        "--master",
        masters,
        "--node-id",
        node_id,
        *(["--advertise", advertise] if advertise else []),
        "--heartbeat-interval-s",
        str(heartbeat_interval_s),
    ]


class LocalServer:
    """One gcache-server on a free loopback port; its output goes to `data_dir`/../gcache-server-PORT.log.

    Used by gcache-bench, gcache-demo and the tests' fixtures.
    """

    def __init__(
        self,
        data_dir: Path,
        memory: str = "1GiB",
        disk: str = "2GiB",
        extra_args=(),
        admin_port: int = 0,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.data_dir = Path(data_dir)
        self.memory = memory
        self.disk = disk
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.admin_port = admin_port
        # Ports this object picked itself: free_port() releases its probe socket, so another
        # process can take the port before the server binds it; start() then re-picks those.
        self._picked = {self.port}
        self._started = False
        self.start_timeout_s = start_timeout_s
        self.log_path = self.data_dir.parent / f"gcache-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self._log: BinaryIO | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, port_attempts: int = 3) -> LocalServer:
        for attempt in range(port_attempts):
            try:
                return self._start_once()
            except RuntimeError as e:
                taken = "Address already in use" in str(e)
                ours = self.port in self._picked or self.admin_port in self._picked
                # Only a first start moves: a restart must come back where clients expect it.
                if not (taken and ours and not self._started) or attempt == port_attempts - 1:
                    raise
                self._repick()
        raise AssertionError("unreachable")

    def pick_admin_port(self) -> LocalServer:
        """Use a free admin port (re-picked like the data port if it is taken at start)."""
        self.admin_port = free_port()
        self._picked.add(self.admin_port)
        return self

    def _repick(self) -> None:
        if self.port in self._picked:
            self.port = free_port()
            self._picked.add(self.port)
            self.log_path = self.data_dir.parent / f"gcache-server-{self.port}.log"
        if self.admin_port in self._picked:
            self.pick_admin_port()

    def _start_once(self) -> LocalServer:
        make_private_dir(self.data_dir)  # 0700: the daemon refuses a dir others may read
        args = server_command(
            host="127.0.0.1",
            port=self.port,
            admin_port=self.admin_port,
            memory=self.memory,
            disk=self.disk,
            data_dir=self.data_dir,
            extra=self.extra_args,
        )
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_listening(self.proc, self.port, self.start_timeout_s, "gcache-server", self.log_tail)
        except BaseException:  # also SIGTERM's SystemExit / Ctrl-C while waiting: no orphan server
            self.kill()
            raise
        self._started = True
        return self

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Sends `sig`, waits, returns the exit code (SIGKILL after `timeout_s`: then -9)."""
        if self.proc is None:
            return 0
        try:
            return stop_process(self.proc, sig, timeout_s)
        finally:
            if self._log is not None:
                self._log.close()
