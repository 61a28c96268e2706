"""The bounded save queue: pages go from vLLM's KV tensors to the store on one thread, off
the forward pass.

A job is one layer's pages of one step (keys, addresses in the registered KV tensors, sizes),
written with batch_put_from straight from those addresses: no copy in Python. A full queue
drops the job (counted; those pages are simply not cached). Jobs marked `volatile` read
blocks vLLM may hand to another request in the next step (sliding-window blocks leave the
window; preempted requests' blocks are freed): the worker waits for them (wait_volatile /
wait_all) before that can happen. Every wait is bounded, and so is every store call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import NamedTuple

log = logging.getLogger("gcache.integrations.vllm")


class SaveJob(NamedTuple):
    keys: list
    addresses: list
    sizes: list
    req_ids: tuple
    volatile: bool
    swa: bool


class Saver:
    def __init__(self, store, stats, jobs_max: int, skip_existing: bool):
        self.store = store
        self.stats = stats
        self.jobs_max = jobs_max
        self.skip_existing = skip_existing
        self._cv = threading.Condition()
        self._queue: deque[SaveJob] = deque()
        self._pending: Counter = Counter()  # req_id -> its jobs not finished
        self._volatile = 0  # volatile jobs not finished
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gcache-vllm-saver", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> bool:
        with self._cv:
            if self._closed or len(self._queue) >= self.jobs_max:
                self.stats.count("save_jobs_dropped")
                return False
            self._queue.append(job)
            for req in set(job.req_ids):
                self._pending[req] += 1
            self._volatile += job.volatile
            self._cv.notify_all()
        return True

    def pending(self, req_id: str) -> int:
        with self._cv:
            return self._pending.get(req_id, 0)

    def _finish(self, job: SaveJob) -> None:
        with self._cv:
            for req in set(job.req_ids):
                self._pending[req] -= 1
                if self._pending[req] <= 0:
                    del self._pending[req]
            self._volatile -= job.volatile
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
            try:
                self._save(job)
            except Exception:  # our bug: the thread must live on, the pages are just not cached
                log.exception("GCache connector: a save failed")
            finally:
                self._finish(job)

    def _save(self, job: SaveJob) -> None:
        start = time.perf_counter()
        todo = range(len(job.keys))
        if self.skip_existing:  # a shared prefix costs one EXISTS entry, not its bytes
            present = self.store.exists_flags(job.keys)
            todo = [i for i, ok in enumerate(present) if not ok]
            self.stats.count("pages_skipped_existing", len(job.keys) - len(todo))
        if todo:
            done = self.store.put_from(
                [job.keys[i] for i in todo], [job.addresses[i] for i in todo], [job.sizes[i] for i in todo]
            )
            saved = [i for i, ok in zip(todo, done) if ok]
            self.stats.count("pages_saved", len(saved))
            self.stats.count("bytes_saved", sum(job.sizes[i] for i in saved))
            self.stats.count("pages_save_failed", len(todo) - len(saved))
            if job.swa:
                self.stats.count("swa_pages_saved", len(saved))
        self.stats.count("save_s", time.perf_counter() - start)

    def _wait(self, done, timeout_s: float, what: str) -> bool:
        with self._cv:
            if self._cv.wait_for(done, timeout_s):
                return True
            # Jobs not started yet would read blocks vLLM is about to reuse: drop them.
            kept = deque(j for j in self._queue if not j.volatile)
            for job in self._queue:
                if job.volatile:
                    self.stats.count("save_jobs_dropped")
                    for req in set(job.req_ids):
                        self._pending[req] -= 1
                        if self._pending[req] <= 0:
                            del self._pending[req]
                    self._volatile -= 1
            self._queue = kept
        log.error("GCache connector: %s did not finish in %.0fs; queued volatile saves dropped", what, timeout_s)
        return False

    def wait_for(self, req_ids: set, timeout_s: float) -> bool:
        """Waits (bounded) until these requests have no save left; drops nothing."""
        with self._cv:
            return self._cv.wait_for(lambda: not any(r in self._pending for r in req_ids), timeout_s)

    def wait_volatile(self, timeout_s: float) -> bool:
        return self._wait(lambda: self._volatile <= 0, timeout_s, "sliding-window saves")

    def wait_all(self, timeout_s: float) -> bool:
        return self._wait(lambda: not self._queue and not self._pending, timeout_s, "saves")

    def close(self, timeout_s: float) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
