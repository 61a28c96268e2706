"""A device made of host memory, for the tests of the transfer state machines.

Work queued on a stream (copies, and "kernels" a test launches on the compute stream) runs only
when something forces it: `synchronize(event)`, or a stream that waits on an event reaching that
wait. So a save that forgot to order its copy after the compute stream copies stale bytes, and a
load that forgot to wait for vLLM's kernels is overwritten by them, as on a GPU; `query` never
runs anything. Streams run in their own order; one lock makes the runs thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from gcache._native import copy_ranges
from gcache.integrations.vllm.transfer.movers.host import HostMover


class StandInStream:
    def __init__(self, name: str):
        self.name = name
        self.ops: deque[Callable[[], None]] = deque()
        self.queued = 0  # operations ever queued
        self.done = 0  # operations ever run (the first `done` of them)


class StandInEvent(NamedTuple):
    stream: StandInStream
    upto: int  # complete once the stream has run this many operations


class StandInDevice(HostMover):
    name = "stand-in"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.compute = StandInStream("compute")

    def new_stream(self, purpose: str) -> StandInStream:
        return StandInStream(purpose)

    def compute_stream(self) -> StandInStream:
        return self.compute

    def _enqueue(self, stream: StandInStream, op: Callable[[], None]) -> None:
        with self._lock:
            stream.ops.append(op)
            stream.queued += 1

    def launch(self, stream: StandInStream, kernel: Callable[[], None]) -> None:
        """Queues a "kernel" (any function) on a stream: the tests' stand-in for vLLM's forward."""
        self._enqueue(stream, kernel)

    def copy(self, stream: StandInStream, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
        d, s, n = (np.array(a, dtype=np.uint64) for a in (dst, src, sizes))  # owned: the caller may reuse its arrays
        self._enqueue(stream, lambda: copy_ranges(d, s, n))

    def record(self, stream: StandInStream) -> StandInEvent:
        with self._lock:
            return StandInEvent(stream, stream.queued)

    def wait_event(self, stream: StandInStream, event: StandInEvent) -> None:
        self._enqueue(stream, lambda: self._run_until(event))

    def query(self, event: StandInEvent) -> bool:
        with self._lock:
            return event.stream.done >= event.upto

    def synchronize(self, event: StandInEvent) -> None:
        self._run_until(event)

    def _run_until(self, event: StandInEvent) -> None:
        with self._lock:
            stream = event.stream
            while stream.done < event.upto:
                op = stream.ops.popleft()
                op()
                stream.done += 1

    def run_all(self, stream: StandInStream) -> None:
        """Runs everything queued on a stream (a test's "the GPU caught up")."""
        with self._lock:
            self._run_until(StandInEvent(stream, stream.queued))
