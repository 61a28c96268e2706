"""The staging pool: host memory allocated once (pinned on a GPU), cut into value-sized slots,
registered once with the GCache client, so `batch_put_from` / `batch_get_into` on slot
addresses move the bytes with no further copy in Python.

Bounded, and never waited for in the forward: a save takes what is free (`take_up_to`) and drops
the rest of its pages (counted); a load that finds too few slots (`take` is all or nothing)
fails, and vLLM recomputes those pages.
"""

from __future__ import annotations

import threading

import numpy as np


class StagingPool:
    def __init__(self, memory: memoryview, slot_bytes: int):
        if slot_bytes < 1 or len(memory) < slot_bytes:
            raise ValueError(f"a staging pool of {len(memory)} bytes cannot hold one {slot_bytes}-byte slot")
        self.memory = memory
        self.slot_bytes = slot_bytes
        self.slot_count = len(memory) // slot_bytes
        self.base = int(np.frombuffer(memory, dtype=np.uint8).ctypes.data)
        self._free = list(range(self.slot_count - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return len(self.memory)

    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """`count` slots, or None when fewer are free (all or nothing)."""
        with self._lock:
            if count > len(self._free):
                return None
            taken = [self._free.pop() for _ in range(count)]
        return taken

    def take_up_to(self, count: int) -> list[int]:
        """As many of `count` slots as are free (maybe none)."""
        with self._lock:
            n = min(count, len(self._free))
            return [self._free.pop() for _ in range(n)]

    def give_back(self, slots: list[int]) -> None:
        with self._lock:
            if len(set(slots)) != len(slots) or set(slots) & set(self._free):
                raise ValueError(f"slots {slots} given back twice")
            self._free.extend(slots)

    def address(self, slot: int) -> int:
        if not 0 <= slot < self.slot_count:
            raise ValueError(f"slot {slot} outside the pool ({self.slot_count} slots)")
        return self.base + slot * self.slot_bytes

    def addresses(self, slots: list[int]) -> np.ndarray:
        return self.base + np.asarray(slots, dtype=np.int64) * self.slot_bytes
