"""A bench's child process (a worker, a router, ...) with its output in a log file."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gcache.common.processes import stop_process, wait_listening


class Proc:
    """One child process with its output in a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], port: int, logdir: Path, start_timeout_s: float = 60.0) -> None:
        self.name, self.port = name, port
        self.start_timeout_s = start_timeout_s
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def wait_listening(self) -> Proc:
        wait_listening(self.proc, self.port, self.start_timeout_s, self.name, self.tail)
        return self

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()
