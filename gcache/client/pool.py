"""A bounded pool of connections to one server, shared by the client's threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gcache import errors
from gcache.client import deadline as call_deadline
from gcache.client.connection import Connection

# A connection idle this long may have been closed by the server's idle timeout
# (300 s by default); it is replaced rather than reused.
IDLE_REUSE_S_MAX = 240.0


class ConnectionPool:
    """At most `size_max` open connections; idle ones are reused last-in first-out."""

    def __init__(self, connect: Callable[[], Connection], size_max: int, acquire_timeout_s: float):
        if size_max < 1:
            raise errors.InvalidArgumentError(f"pool_size must be >= 1, got {size_max}")
        self._connect = connect
        self.size_max = size_max
        self._acquire_timeout_s = acquire_timeout_s
        # Held directly (`with self._lock`, a C call) on the common paths; the Condition over
        # it is only waited on and notified when a caller waits for a connection.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # callers in acquire() waiting for a connection
        self._idle: list[tuple[Connection, float]] = []
        self._open = 0
        self._closed = False

    def acquire(self) -> Connection:
        with self._lock:
            deadline = None
            while True:
                if self._closed:
                    raise errors.ClientClosedError("this gcache.Client was closed; create a new one")
                if self._idle:
                    conn, idle_since = self._idle.pop()
                    if time.monotonic() - idle_since < IDLE_REUSE_S_MAX:
                        conn.reused = True
                        return conn
                    conn.close()
                    self._open -= 1
                    continue
                if self._open < self.size_max:
                    self._open += 1
                    break
                if deadline is None:
                    wait_s = self._acquire_timeout_s
                    call = call_deadline.current()  # the call's deadline caps the wait
                    if call is not None:
                        wait_s = call.cap(wait_s)
                    deadline = time.monotonic() + wait_s
                left = deadline - time.monotonic()
                self._waiting += 1
                try:
                    woken = left > 0 and self._cond.wait(left)
                finally:
                    self._waiting -= 1
                if not woken:
                    if not self._idle and self._open >= self.size_max:
                        raise errors.PoolExhaustedError(
                            f"all {self.size_max} pooled connections stayed busy for "
                            f"{wait_s:.3g}s: raise pool_size or use fewer threads"
                        )
        try:
            return self._connect()  # outside the lock: connecting can take a while
        except BaseException:
            with self._lock:
                self._open -= 1
                self._notify()
            raise

    def take_idle(self) -> Connection | None:
        """An idle connection fit for reuse, or None (none idle, or the pool closed): never
        waits and never connects (gcache.client.one_key; acquire() does the rest)."""
        with self._lock:
            if self._idle and not self._closed:
                conn, idle_since = self._idle[-1]
                if time.monotonic() - idle_since < IDLE_REUSE_S_MAX:
                    self._idle.pop()
                    conn.reused = True
                    return conn
        return None

    def _notify(self) -> None:
        """Wakes one waiting acquire() (the lock held); nothing to do when none waits."""
        if self._waiting:
            self._cond.notify()

    def adopt(self, conn: Connection) -> None:
        """Adds an open connection (made while choosing the transport) as idle."""
        with self._lock:
            if self._closed or self._open >= self.size_max:
                conn.close()
                return
            self._open += 1
            self._idle.append((conn, time.monotonic()))
            self._notify()

    def release(self, conn: Connection) -> None:
        """Returns a connection; a broken one (or any after close()) is closed instead."""
        with self._lock:
            if conn.broken or self._closed:
                conn.close()
                self._open -= 1
            else:
                self._idle.append((conn, time.monotonic()))
            self._notify()

    def discard_idle(self) -> None:
        """Closes every idle connection: after one failed, the rest are likely stale too."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for conn, _ in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.discard_idle()

    @property
    def open_count(self) -> int:
        return self._open
