"""A bounded queue of jobs run in order on one thread of its own: the adapters' savers and
loaders. A full (or closed) queue refuses a job at once, so the engine's thread never waits
to enqueue; a job that raises is logged and counted, and the thread lives on."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")


class JobQueue(Generic[Job]):
    def __init__(self, name: str, run: Callable[[Job], None], jobs_max: int, log: logging.Logger):
        if jobs_max < 1:
            raise ValueError("jobs_max must be >= 1")
        self.name = name
        self.jobs_max = jobs_max
        self._run_job = run
        self._log = log
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running = 0  # 1 while a job is out of the queue and not finished
        self._closed = False
        self.failures = 0  # jobs that raised
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queues the job; False (and nothing queued) when the queue is full or closed."""
        with self._cv:
            if self._closed or len(self._queue) >= self.jobs_max:
                return False
            self._queue.append(job)
            self._cv.notify_all()
        return True

    def has_room(self) -> bool:
        with self._cv:
            return not self._closed and len(self._queue) < self.jobs_max

    def pending(self) -> int:
        """Jobs queued or running now."""
        with self._cv:
            return len(self._queue) + self._running

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = 1
            try:
                self._run_job(job)
            except Exception:  # our bug: the thread must live on; the job's own handler reports it
                self.failures += 1
                self._log.exception("%s: a job failed", self.name)
            finally:
                with self._cv:
                    self._running = 0
                    self._cv.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits (bounded) until every queued job has run; True when they have."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._running, timeout_s)

    def drain(self) -> list[Job]:
        """Takes the jobs not started yet out of the queue (the caller settles them)."""
        with self._cv:
            jobs, self._queue = list(self._queue), deque()
        return jobs

    def close(self, timeout_s: float) -> bool:
        """Runs what is queued, then stops the thread; True when it stopped in time."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
