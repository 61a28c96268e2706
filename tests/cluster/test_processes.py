"""gcache.common.processes: free ports, waiting for a listener, and the one way every launcher stops a process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from gcache.common.processes import (
    PidProcess,
    free_port,
    pid_alive,
    running,
    stop_process,
    stop_processes,
    wait_listening,
)

pytestmark = pytest.mark.process  # starts processes

WAIT_S = 20.0  # bound on every wait; generous for a loaded 2-core box
MARKER = "gcache-test-processes-marker"


def _child(code: str, *, new_session: bool = False) -> subprocess.Popen:
    """A Python child that runs `code`, then says 'ready' and sleeps until it is stopped;
    proc.said holds what `code` printed before that."""
    script = f"import signal, sys, time\n{code}\nprint('ready', flush=True)\ntime.sleep(600)\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, MARKER], stdout=subprocess.PIPE, text=True, start_new_session=new_session
    )
    proc.said = []
    for line in proc.stdout:  # ends at 'ready' (its signal handlers are in place) or at its exit
        if line == "ready\n":
            return proc
        proc.said.append(line.strip())
    raise RuntimeError(f"child exited before 'ready' ({proc.wait(WAIT_S)}): {proc.said}")


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_sigterm_stops_and_reaps():
    proc = _child("")
    assert stop_process(proc) == -signal.SIGTERM
    assert proc.returncode == -signal.SIGTERM and not running(proc)


def test_a_process_that_ignores_sigterm_gets_sigkill():
    proc = _child("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    assert stop_process(proc, timeout_s=0.5) == -signal.SIGKILL


def test_a_paused_process_is_resumed_so_it_acts_on_sigterm():
    # A handler (as every server has): while stopped it cannot run; without SIGCONT this ends in SIGKILL.
    proc = _child("signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))")
    proc.send_signal(signal.SIGSTOP)
    assert stop_process(proc, timeout_s=WAIT_S) == 5


def test_a_clean_exit_code_comes_back_and_an_exited_process_is_left_alone():
    proc = _child("signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))")
    assert stop_process(proc, timeout_s=WAIT_S) == 3
    assert stop_process(proc) == 3  # again: nothing to signal, same code


def test_group_reaches_the_grandchildren():
    spawn = (
        "import subprocess; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        " print(g.pid, flush=True)"
    )
    proc = _child(spawn, new_session=True)
    grandchild = int(proc.said[0])
    assert pid_alive(grandchild)
    assert stop_process(proc, signal.SIGKILL, group=True) == -signal.SIGKILL
    assert _wait_gone(grandchild), "SIGKILL to the group left the grandchild running"


def test_stop_processes_stops_them_together():
    procs = [_child(""), _child("signal.signal(signal.SIGTERM, signal.SIG_IGN)"), _child("")]
    assert stop_processes(procs, timeout_s=0.5) == [-signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM]


def test_pid_process_signals_only_a_process_whose_command_line_names_the_marker():
    proc = _child("")
    try:
        stranger = PidProcess(proc.pid, "some-other-cluster-dir")
        assert not stranger.running()
        assert stop_process(stranger, signal.SIGKILL) is None
        assert proc.poll() is None, "a pid whose command line lacks the marker was signalled"
        ours = PidProcess(proc.pid, MARKER)
        assert ours.running()
        assert stop_process(ours, timeout_s=WAIT_S) is None  # another's child: no exit code to read
        assert proc.wait(WAIT_S) == -signal.SIGTERM
        assert not ours.running() and not PidProcess(0, MARKER).running()
    finally:
        stop_process(proc, signal.SIGKILL)


def test_wait_listening_returns_once_the_port_accepts():
    port = free_port()
    proc = _child(f"import socket; s = socket.create_server(('127.0.0.1', {port}))")
    try:
        wait_listening(proc, port, WAIT_S, "listener")
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S):
            pass
    finally:
        stop_process(proc)


def test_wait_listening_says_when_the_process_exits_or_never_listens():
    port = free_port()
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    with pytest.raises(RuntimeError, match="early exited with 4 at start:\ntail"):
        wait_listening(gone, port, WAIT_S, "early", lambda: "tail")
    silent = _child("")
    try:
        with pytest.raises(RuntimeError, match=f"silent did not listen on 127.0.0.1:{port} within 0.3s"):
            wait_listening(silent, port, 0.3, "silent")
    finally:
        stop_process(silent)


def test_free_port_binds():
    port = free_port("127.0.0.2")
    with socket.create_server(("127.0.0.2", port)):
        pass
