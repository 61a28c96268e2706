"""A gcache-bench stopped with SIGTERM (a CI timeout, `kill`, systemd) stops the local
gcache-server it started and removes its temp folder, instead of leaving them behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

DEADLINE_S = 120.0


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_local_server_and_removes_the_temp_folder(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcache.tools.storebench.main",
            "--workload",
            "put",
            "--duration",
            "60s",
            "--memory",
            "64MiB",
            "--disk",
            "64MiB",
            "--no-progress",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        server = None
        deadline = time.monotonic() + DEADLINE_S
        while server is None and time.monotonic() < deadline and bench.poll() is None:
            server = next(
                (c for c in _children(bench.pid) if "gcache-server" in _cmdline(c) or "gcache.server" in _cmdline(c)),
                None,
            )
            time.sleep(0.1)
        assert server is not None, "gcache-bench never started its local gcache-server"
        assert any(tmp_path.iterdir()), "the bench's temp folder is where TMPDIR says"
        bench.send_signal(signal.SIGTERM)
        rc = bench.wait(timeout=DEADLINE_S)
        assert rc == 128 + signal.SIGTERM, bench.stderr.read().decode()[-2000:] if bench.stderr else rc
        assert not _alive(server), f"gcache-server {server} outlived the bench"
        assert not list(tmp_path.iterdir()), "the bench's temp folder was left behind"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
