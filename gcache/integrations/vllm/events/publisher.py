"""A ZMQ PUB socket of the connector's own, on its own thread: vLLM's ZmqEventPublisher wire.

Each message is multipart (topic, 8-byte big-endian sequence number, msgpack EventBatch), the
sequence counting messages from 0 since this process started (a consumer that sees it go
back knows the publisher restarted; one that sees a gap knows it missed messages). There is
no replay socket: a late subscriber learns from the next announcements only.

publish() never blocks its caller: the queue is bounded, and when it is full the batch is
dropped and counted (`dropped`). ZMQ's own send high-water mark bounds what waits per
subscriber (then PUB drops for that subscriber, as vLLM's does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gcache.serving.announce.wire import Event, event_batch, frames

log = logging.getLogger("gcache.integrations.vllm.events")

SNDHWM = 100_000  # messages ZMQ keeps per subscriber before dropping


class Sink(Protocol):
    """Where the frames go (a ZMQ PUB socket; a list in tests). Used by one thread only."""

    def send(self, frames: list[bytes]) -> None: ...

    def close(self) -> None: ...


class ZmqSink:
    """A bound (or connected) PUB socket. Built on the publisher's thread: ZMQ sockets are not
    thread-safe."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._zmq = zmq
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, SNDHWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or endpoint.startswith("ipc://"):
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)  # e.g. to a router's --bind SUB socket

    def send(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames, copy=False)

    def close(self) -> None:
        self.socket.close(0)


class EventPublisher:
    def __init__(
        self,
        topic: str,
        sink_factory: Callable[[], Sink],
        queue_max: int = 1024,
        data_parallel_rank: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self.clock = clock
        self.queue: queue.Queue[list[Event] | None] = queue.Queue(maxsize=queue_max)
        self.seq = 0
        self.stats = dict.fromkeys(("published", "dropped", "send_errors", "events"), 0)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sink_factory,), name="gcache-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:  # a bad endpoint (in use, malformed) is an error at the engine's start
            raise self._error

    def publish(self, events: Sequence[Event]) -> bool:
        """Queue one batch; False (dropped, counted) when the queue is full. Never blocks."""
        if not events:
            return True
        try:
            self.queue.put_nowait(list(events))
        except queue.Full:
            self.stats["dropped"] += 1
            return False
        return True

    def _run(self, sink_factory: Callable[[], Sink]) -> None:
        try:
            sink = sink_factory()
        except Exception as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                events = self.queue.get()
                if events is None:
                    return
                payload = event_batch(self.clock(), events, self.rank)
                try:
                    sink.send(frames(self.topic, self.seq, payload))
                except Exception as exc:  # noqa: BLE001 - a send failure must not end the thread
                    self.stats["send_errors"] += 1
                    if self.stats["send_errors"] == 1:
                        log.warning("GCache KV events: send failed: %s", exc)
                    continue
                self.seq += 1
                self.stats["published"] += 1
                self.stats["events"] += len(events)
        finally:
            sink.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (bounded by timeout_s), then close the socket."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self.queue.put(None, timeout=0.1)
                break
            except queue.Full:
                continue
        self._thread.join(max(0.0, deadline - time.monotonic()))
