"""Reading pages into vLLM's blocks: `load_pages` (one batch_get_into straight into the
block addresses), and the Loader thread that runs loads between steps for requests vLLM
parks in WAITING_FOR_REMOTE_KVS (load_kv_async). Bounded queue; a load that finds it full
fails at once (vLLM recomputes the request's pages)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import NamedTuple

log = logging.getLogger("gcache.integrations.vllm")


class LoadJob(NamedTuple):
    req_id: str
    keys: list
    addresses: list
    sizes: list
    blocks: list  # per key, the vLLM block it fills


def load_pages(store, stats, job: LoadJob) -> set[int]:
    """Reads every key into its block; returns the blocks whose read failed (miss, bad
    checksum, short value, store down)."""
    start = time.perf_counter()
    got = store.get_into(job.keys, job.addresses, job.sizes)
    failed = {b for b, g, size in zip(job.blocks, got, job.sizes) if g != size}
    ok = sum(1 for b, g, size in zip(job.blocks, got, job.sizes) if g == size and b not in failed)
    stats.count("pages_loaded", ok)
    stats.count("bytes_loaded", sum(size for b, g, size in zip(job.blocks, got, job.sizes) if g == size))
    stats.count("load_failed_pages", len(failed))
    stats.count("load_s", time.perf_counter() - start)
    return failed


class Loader:
    def __init__(self, store, stats, jobs_max: int):
        self.store = store
        self.stats = stats
        self.jobs_max = jobs_max
        self._cv = threading.Condition()
        self._queue: deque[LoadJob] = deque()
        self._done: list[tuple[str, set]] = []  # (req_id, failed blocks)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gcache-vllm-loader", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob) -> None:
        with self._cv:
            if self._closed or len(self._queue) >= self.jobs_max:
                self._done.append((job.req_id, set(job.blocks)))  # nothing read: every block failed
                return
            self._queue.append(job)
            self._cv.notify_all()

    def take_done(self) -> list[tuple[str, set]]:
        with self._cv:
            done, self._done = self._done, []
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue[0]
            try:
                failed = load_pages(self.store, self.stats, job)
            except Exception:  # our bug: report the load failed, vLLM recomputes
                log.exception("GCache connector: a load failed")
                failed = set(job.blocks)
            with self._cv:
                self._queue.popleft()
                self._done.append((job.req_id, failed))
                self._cv.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue, timeout_s)

    def close(self, timeout_s: float) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
