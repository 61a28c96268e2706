"""The contract of a one-sided transport's arena: how a connection's reads and writes move
bytes once the server has answered where they lie (transports/shm_ops.py drives it).

`MappedArena` (transports/shm.py) copies over the server's memfd mapped into this process;
`RdmaArena` (transports/rdma.py) posts RDMA READs and WRITEs through a staging buffer. A
`Connection` holds one (`conn.arena`), so the contract sits below both the connection and the
transports that implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class Arena(ABC):
    lease_s: float  # how long a LOOKUP lease lasts on the server (inf: every value is verified)
    put_kind: int  # the checksum (ChecksumKind) written values get: what the node speaks

    @abstractmethod
    def check_answer(self, meta: dict[str, Any]) -> None:
        """Checks (and takes) what a LOOKUP / RESERVE answer says of where the arena is."""

    @abstractmethod
    def read_into(
        self,
        offsets: Sequence[int],
        lens: Sequence[int],
        sums: Sequence[int],
        dests: Sequence[memoryview | None],
        verify: bool,
        kinds: Sequence[int] = (),
    ) -> list[int]:
        """Copies value i (lens[i] bytes at offsets[i]; < 0: not there) into dests[i]; the
        indices whose bytes did not match their checksum."""

    @abstractmethod
    def read_values(
        self, offsets: Sequence[int], lens: Sequence[int], sums: Sequence[int], verify: bool, kinds: Sequence[int] = ()
    ) -> tuple[list[Any], list[int]]:
        """The values as bytes (None where lens[i] < 0), and the indices that failed their checksum."""

    @abstractmethod
    def write_from(self, offsets: Sequence[int], views: Sequence[memoryview]) -> list[int]:
        """Writes views[i] at offsets[i] (< 0: skipped); each written value's checksum (put_kind)."""

    @abstractmethod
    def close(self) -> None:
        """Lets go of the mapping or the queue pair."""
