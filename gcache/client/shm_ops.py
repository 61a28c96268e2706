"""Operations of the one-sided transports (docs/protocol.md, "Shared memory and RDMA").

A read is one LOOKUP round trip (offsets, lengths, checksums, under a lease),
then the client copies the values out of the arena itself and verifies each
one's xxh64 in the same pass, then drops the lease with a RELEASE that needs
no answer. A write is a RESERVE (arena blocks to write), the copy (hashing the
written bytes), then a COMMIT that publishes the blocks; the server checks the
checksums again. How bytes move is the connection's `arena` (an ArenaCopier):
memcpy over the mapped memfd (shm) or RDMA READ / WRITE (rdma).
"""
from __future__ import annotations

from gcache import errors
from gcache.client.operations import BatchResult, Operation, _ValuesOp, _expect_list
from gcache.protocol import FLAG_NO_REPLY, Opcode, PutStatus, encode_header, encode_meta


def release_frame(lease: int) -> bytes:
    """RELEASE of one lease, answered by nothing (FLAG_NO_REPLY): reads stay one round trip."""
    meta = encode_meta({"leases": [lease]})
    return encode_header(Opcode.RELEASE, 0, len(meta), 0, flags=FLAG_NO_REPLY) + meta


def _arena(conn):
    arena = conn.arena
    if arena is None:
        conn.broken = True
        raise errors.ProtocolError(f"connection to {conn.address} has no arena mapped (attach failed)")
    return arena


class LookupOp(_ValuesOp):
    """GET through the arena: into `targets` (byte views, one per key), or new bytes with None."""

    opcode = Opcode.LOOKUP

    def __init__(self, result: BatchResult, lo: int, hi: int, targets: list | None):
        super().__init__(result, lo, hi, verify_checksums=True)
        self.targets = targets

    def part(self, lo, hi):
        targets = None if self.targets is None else self.targets[lo - self.lo:hi - self.lo]
        return LookupOp(self.result, lo, hi, targets)

    def on_response(self, conn, meta, payload_len):
        n = self.hi - self.lo
        offsets = _expect_list(meta, "offs", n)
        lens = _expect_list(meta, "lens", n)
        sums = _expect_list(meta, "sums", n)
        lease = meta.get("lease")
        if not isinstance(lease, int) or payload_len:
            raise errors.ProtocolError(f"LOOKUP answer has lease {lease!r} and payload {payload_len}")
        try:
            arena = _arena(conn)
            arena.check_answer(meta)
            if self.targets is None:
                values, bad = arena.read_values(offsets, lens, sums)
                self.result.values[self.lo:self.hi] = values
            else:
                bad = self._read_into(arena, offsets, lens, sums)
        finally:
            if lease:
                conn.send([release_frame(lease)])
        for j in bad:
            self.result.bad_checksum.append(self.lo + j)
            self.result.values[self.lo + j] = None

    def _read_into(self, arena, offsets, lens, sums) -> list[int]:
        out = self.result.values
        dests = []
        for j, size in enumerate(lens):
            target = self.targets[j]
            if size < 0:
                out[self.lo + j] = None
                dests.append(None)
            elif size > len(target):  # never write past a caller's buffer
                out[self.lo + j] = None
                self.result.too_small.append((self.lo + j, size))
                dests.append(None)
            else:
                out[self.lo + j] = size
                dests.append(target)
        return arena.read_into(offsets, lens, sums, dests)

    def read_values(self, conn, lens, sums, payload_len):  # not used: on_response reads
        raise NotImplementedError


class ReserveOp(Operation):
    """PUT through the arena, first half: RESERVE, write the reserved blocks, then a CommitOp."""

    opcode = Opcode.RESERVE

    def __init__(self, result: BatchResult, lo: int, hi: int, values: list):
        super().__init__(result, lo, hi)
        self.values = values  # byte views for keys lo..hi-1
        self.commit: CommitOp | None = None

    def request_meta_bytes(self, epoch):
        meta = {"keys": self.keys, "lens": [len(v) for v in self.values]}
        if epoch is not None:
            meta["epoch"] = epoch
        return encode_meta(meta)

    def on_response(self, conn, meta, payload_len):
        n = self.hi - self.lo
        statuses = _expect_list(meta, "st", n)
        offsets = _expect_list(meta, "offs", n)
        res = meta.get("res")
        if not isinstance(res, int) or payload_len:
            raise errors.ProtocolError(f"RESERVE answer has res {res!r} and payload {payload_len}")
        out = self.result.values
        write_at = [-1] * n
        for j, st in enumerate(statuses):
            i = self.lo + j
            if st == PutStatus.STORED:
                write_at[j] = offsets[j]
                out[i] = False  # until COMMIT says
            elif st == PutStatus.EXISTS:
                out[i] = True
            elif st == PutStatus.NO_SPACE:
                out[i] = False
            elif st == PutStatus.VALUE_TOO_LARGE:
                out[i] = False
                self.result.too_large.append(i)
            elif st == PutStatus.KEY_INVALID:
                raise errors.KeyInvalidError(f"gcache-server rejected key {self.result.keys[i]!r}")
            else:
                raise errors.ProtocolError(f"unknown reserve status {st!r} for key {self.result.keys[i]!r}")
        if not res:
            return
        arena = _arena(conn)
        arena.check_answer(meta)
        sums = arena.write_from(write_at, self.values)
        self.commit = CommitOp(self.result, self.lo, self.hi, res, sums, write_at)

    def follow_ups(self):
        return [self.commit] if self.commit is not None else None


class CommitOp(Operation):
    """PUT through the arena, second half: publish the blocks written (the server
    verifies every checksum; the reservation's epoch decides staleness)."""

    opcode = Opcode.COMMIT

    def __init__(self, result, lo, hi, res: int, sums: list[int], written: list[int]):
        super().__init__(result, lo, hi)
        self.res = res
        self.sums = sums
        self.written = written  # offset per key, -1 where nothing was reserved

    def request_meta_bytes(self, epoch):
        return encode_meta({"res": self.res, "sums": self.sums})

    def on_response(self, conn, meta, payload_len):
        statuses = _expect_list(meta, "st", self.hi - self.lo)
        conn.skip(payload_len)
        out = self.result.values
        for j, st in enumerate(statuses):
            if self.written[j] < 0:
                continue  # answered by the RESERVE
            i = self.lo + j
            if st == PutStatus.STORED or st == PutStatus.EXISTS:
                out[i] = True
            elif st == PutStatus.CHECKSUM_MISMATCH:
                out[i] = False
                self.result.bad_checksum.append(i)
            else:
                out[i] = False


def lookup_ops(result, slices, targets):
    return [LookupOp(result, lo, hi, None if targets is None else targets[lo:hi]) for lo, hi in slices]


def reserve_ops(result, slices, views):
    return [ReserveOp(result, lo, hi, views[lo:hi]) for lo, hi in slices]

