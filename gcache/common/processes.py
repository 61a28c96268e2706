"""Local child processes: a free port to give one, waiting until it listens, and stopping it.

Every launcher (gcache-bench's LocalServer, LocalMaster, LocalCluster, the bench peers, the
tests' helpers) stops its processes the same way, through stop_process / stop_processes:
the signal asked for (SIGTERM by default) plus SIGCONT, so a paused process can act on it;
a bounded wait; then SIGKILL and a second bounded wait, reaping every child of ours.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any, overload

STOP_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 10.0  # after SIGKILL only the kernel's teardown is left to wait for
POLL_S = 0.02


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, so `finally` blocks stop what a launcher
    started (the default action would kill the process and leave its children running)."""

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (any 127.0.0.x works on Linux)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_listening(
    proc: subprocess.Popen[Any],
    port: int,
    timeout_s: float,
    what: str,
    log_tail: Callable[[], str] = lambda: "",
    host: str = "127.0.0.1",
) -> None:
    """Returns once `host`:`port` accepts; raises RuntimeError if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} at start:\n{log_tail()}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {host}:{port} within {timeout_s}s:\n{log_tail()}")


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited: it only waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class PidProcess:
    """A process known only by its pid, e.g. one another process started (read from a layout file).

    `marker` must appear in its command line, so a pid the kernel has since reused for something
    else is never signalled. Its exit code belongs to its parent: returncode stays None.
    """

    returncode: int | None = None

    def __init__(self, pid: int, marker: str):
        self.pid = pid
        self.marker = marker

    def running(self) -> bool:
        if self.pid <= 0 or not pid_alive(self.pid):
            return False
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                return self.marker.encode() in f.read()
        except OSError:
            return False

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


Process = subprocess.Popen[Any] | PidProcess


def running(proc: Process) -> bool:
    if isinstance(proc, PidProcess):
        return proc.running()
    return proc.poll() is None  # poll() also reaps a child that has exited


def _send(proc: Process, sig: int, group: bool) -> None:
    if not running(proc):
        return
    try:
        if group:
            os.killpg(proc.pid, sig)  # the process was started with start_new_session=True
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _wait_gone(procs: list[Process], timeout_s: float) -> bool:
    """Whether every one of `procs` has exited within `timeout_s` (one deadline for all)."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        while running(proc):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if isinstance(proc, PidProcess):
                time.sleep(min(POLL_S, left))
                continue
            try:
                proc.wait(left)
            except subprocess.TimeoutExpired:
                return False
    return True


def stop_processes(
    procs: Iterable[Process], sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S, *, group: bool = False
) -> list[int | None]:
    """Sends `sig` to every one of `procs` still running, then waits for all of them together
    (`timeout_s` in all); SIGKILL for any still running then. With group=True every signal goes
    to the process's whole process group. Returns the exit codes (negative: the signal that
    ended it; None for a PidProcess). TimeoutError if one outlives SIGKILL by KILL_TIMEOUT_S."""
    procs = list(procs)
    for proc in procs:
        _send(proc, sig, group)
        if sig not in (signal.SIGKILL, signal.SIGCONT):
            _send(proc, signal.SIGCONT, group)  # a stopped process acts on no signal but SIGKILL
    if not _wait_gone(procs, timeout_s):
        for proc in procs:
            _send(proc, signal.SIGKILL, group)
        if not _wait_gone(procs, KILL_TIMEOUT_S):
            pids = [p.pid for p in procs if running(p)]
            raise TimeoutError(f"pids {pids} still run {KILL_TIMEOUT_S}s after SIGKILL")
    return [proc.returncode for proc in procs]


@overload
def stop_process(proc: subprocess.Popen[Any], sig: int = ..., timeout_s: float = ..., *, group: bool = ...) -> int: ...
@overload
def stop_process(proc: PidProcess, sig: int = ..., timeout_s: float = ..., *, group: bool = ...) -> None: ...
def stop_process(
    proc: Process, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S, *, group: bool = False
) -> int | None:
    """stop_processes for one process: its exit code (None if never ours to read)."""
    return stop_processes([proc], sig, timeout_s, group=group)[0]
