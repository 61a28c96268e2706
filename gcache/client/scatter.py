"""Reads straight from a same-host server's arena into many places per value: a value's
bytes go in runs to caller-owned memory (an engine's KV blocks), with no staging copy.

`ServerClient.batch_get_scatter` over the shm transport only: one LOOKUP round trip, then
one native pass (gcache._native.shm_read_scatter) that checks each value's checksum on the
arena's bytes before any of its runs is copied, so a value that fails its check writes
nothing and is a miss. A value whose size is not the size the caller expects is a miss too
(never copied), and so is every value of a call that outlived its lease (its bytes may
have changed after they were checked). Values come leased, never inline (`inline_max` 0).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

from gcache import errors
from gcache.client.operations import encode_request_meta
from gcache.client.transports.shm_ops import LEASE_TRUST, LookupOp

if TYPE_CHECKING:
    import numpy as np

    from gcache.client.arena import Arena


class ScatterRuns(NamedTuple):
    """Where each value of a batch goes: value i is sizes[i] bytes; its runs are
    first[i] .. first[i + 1] - 1, run r taking lens[r] bytes at offset at[r] of the value
    to address dst[r]. numpy uint64 arrays (first has one entry more than there are keys)."""

    sizes: list[int]
    first: np.ndarray
    dst: np.ndarray
    at: np.ndarray
    lens: np.ndarray

    def check(self, n: int) -> None:
        if len(self.sizes) != n or len(self.first) != n + 1:
            raise errors.InvalidArgumentError(f"scatter runs for {len(self.sizes)} values, not {n}")
        runs = int(self.first[-1]) if n else 0
        if not (len(self.dst) == len(self.at) == len(self.lens) == runs):
            raise errors.InvalidArgumentError("scatter runs: dst, at and lens must have first[-1] entries")

    def part(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Values lo..hi-1's (first, dst, at, lens), rebased to run 0."""
        r0, r1 = int(self.first[lo]), int(self.first[hi])
        return self.first[lo : hi + 1] - self.first[lo], self.dst[r0:r1], self.at[r0:r1], self.lens[r0:r1]


class ScatterLookupOp(LookupOp):
    """A LOOKUP whose values are copied out of the arena into their runs (module text)."""

    def __init__(self, result, lo: int, hi: int, runs: ScatterRuns, verify: bool):
        super().__init__(result, lo, hi, None, verify)
        self.runs = runs

    def part(self, lo, hi):
        return ScatterLookupOp(self.result, lo, hi, self.runs, self.verify)

    def request_meta_bytes(self, epoch):
        return encode_request_meta({"keys": self.keys, "inline_max": 0, "ck": 1, "vfy": True}, epoch)

    def _read_inline(self, conn, lens, sums, kinds, inlined) -> list[int]:
        """Never asked for (inline_max 0); a zero-byte value a node sends anyway is a miss."""
        for j, (size, inl) in enumerate(zip(lens, inlined)):
            if inl and size >= 0:
                conn.skip(size)
                self.result.values[self.lo + j] = None
        return []

    def _read_leased(self, arena: Arena, offsets, leased, sums, kinds, unchecked: bool) -> list[int]:
        read = getattr(arena, "read_scatter", None)
        if read is None:  # cannot happen: batch_get_scatter checks the transport
            raise errors.TransportUnavailableError("batch_get_scatter: this connection's arena is not mapped memory")
        trusted_until = self.sent_at + arena.lease_s * LEASE_TRUST
        out = self.result.values
        wanted = self.runs.sizes
        lens = [size if size >= 0 and size == wanted[self.lo + j] else -1 for j, size in enumerate(leased)]
        first, dst, at, run_lens = self.runs.part(self.lo, self.hi)
        bad = set(read(offsets, lens, sums, kinds, first, dst, at, run_lens, self.verify or unchecked))
        # Past the lease the node may have reused the blocks during the copy: misses, all of them
        # (their runs are recomputed by the caller; nothing was checked against changed bytes).
        expired = time.monotonic() > trusted_until
        for j, size in enumerate(lens):
            out[self.lo + j] = size if size >= 0 and j not in bad and not expired else None
        return sorted(bad)
