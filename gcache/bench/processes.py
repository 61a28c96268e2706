"""Stopping a child process the same way everywhere: SIGTERM, a bounded wait, then SIGKILL."""
from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Terminate `proc` (if it still runs) and reap it; kill -9 if it ignores SIGTERM for timeout_s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)
