"""Operations of the one-sided transports (docs/protocol.md, "Shared memory and RDMA").

A read is one LOOKUP round trip (offsets, lengths, checksums, under a lease),
then the client copies the values out of the arena itself, checking each
value's checksum in the same pass, then drops the lease with a RELEASE that
needs no answer. A COMMIT publishes a writer's bytes with the sum that writer
declared, unread by the node (one memory pass per put); the node checks them
later (its scrubber, or a read that sends them), and until then the reader is
where a lying or torn write is caught (docs/security.md, "Checksums a writer
declares"). The LOOKUP says this client checks ("vfy"); the answer says which
values the node has checked ("vf"). A batch with any unchecked value is hashed
in the copy loop; one of checked values only, copied while its lease provably
held (the lease began after the LOOKUP was sent, so a copy over before `sent +
lease`, this process's clock less a margin), needs no hash, as a GET_BATCH read
needs none; a later copy, or a client with verify_checksums, checks every
value. A value whose bytes do not match is never a hit, and its arena offset
goes back in the RELEASE ("bad") for the node to check and remove. Values that
come inline in the answer were checked by the node. A write is a RESERVE (arena
blocks to write), the copy (hashing the written bytes), then a COMMIT that
publishes the blocks. How bytes move is the connection's `arena`
(gcache.client.arena.Arena): memcpy over the mapped memfd (shm) or RDMA READ /
WRITE (rdma).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from gcache import errors
from gcache._native import verify_views
from gcache.client.arena import Arena
from gcache.client.connection import Connection
from gcache.client.operations import (
    BatchResult,
    Operation,
    _expect_list,
    _ValuesOp,
    encode_request_meta,
    record_put_status,
    record_put_statuses,
)
from gcache.wire.protocol import (
    FLAG_NO_REPLY,
    ChecksumKind,
    Opcode,
    PutStatus,
    encode_header,
    encode_keys_meta,
    encode_meta,
)
from gcache.wire.worth import worth_field


def release_frame(lease: int, bad_offsets: Sequence[int] = ()) -> bytes:
    """RELEASE of one lease, answered by nothing (FLAG_NO_REPLY): reads stay one round trip.
    `bad_offsets`: arena offsets of leased values whose copy did not match its sum."""
    meta = encode_meta({"leases": [lease], "bad": list(bad_offsets)} if bad_offsets else {"leases": [lease]})
    return encode_header(Opcode.RELEASE, 0, len(meta), 0, flags=FLAG_NO_REPLY) + meta


# Values up to this size come back inside the LOOKUP answer, unleased: below it a
# socket copy costs less than a lease, a copy and a RELEASE.
INLINE_BYTES_MAX = 16 * 1024
# msgpack of the map entries "inline_max": INLINE_BYTES_MAX (a uint16) and "vfy": true,
# appended to a one-key request map (encode_keys_meta's) instead of packing a dict per call.
_LOOKUP_FIELDS = b"\xaainline_max\xcd" + INLINE_BYTES_MAX.to_bytes(2, "big") + b"\xa3vfy\xc3"
# A lease is trusted for this share of its length: the server's deadline and this
# process's clock may run at slightly different rates.
LEASE_TRUST = 0.9


def _arena(conn: Connection) -> Arena:
    arena = conn.arena
    if arena is None:
        conn.broken = True
        raise errors.ProtocolError(f"connection to {conn.address} has no arena mapped (attach failed)")
    return arena


class LookupOp(_ValuesOp):
    """GET through the arena: into `targets` (byte views, one per key), or new bytes with None."""

    opcode = Opcode.LOOKUP

    def __init__(self, result: BatchResult, lo: int, hi: int, targets: list | None, verify: bool):
        super().__init__(result, lo, hi, verify_checksums=verify)
        self.targets = targets
        self.sent_at = 0.0

    def part(self, lo, hi):
        targets = None if self.targets is None else self.targets[lo - self.lo : hi - self.lo]
        return LookupOp(self.result, lo, hi, targets, self.verify)

    def frame(self, request_id, epoch=None):
        self.sent_at = time.monotonic()  # the server's lease starts after this
        return super().frame(request_id, epoch)

    def request_meta_bytes(self, epoch):
        # "ck": this client reads "cks" (the kind of each value's sum); "vfy": it checks
        # every leased value's sum itself (so the node need not read them first).
        if self.hi - self.lo == 1:  # a single GET: no dict packed per call
            meta = encode_keys_meta(self.keys, epoch, ck=True)  # a fixmap of 2 or 3 entries
            return bytes((meta[0] + 2,)) + meta[1:] + _LOOKUP_FIELDS
        return encode_request_meta({"keys": self.keys, "inline_max": INLINE_BYTES_MAX, "ck": 1, "vfy": True}, epoch)

    def on_response(self, conn, meta, payload_len):
        n = self.hi - self.lo
        offsets = _expect_list(meta, "offs", n)
        lens = _expect_list(meta, "lens", n)
        sums = _expect_list(meta, "sums", n)
        kinds = _expect_list(meta, "cks", n) if "cks" in meta else []  # none: all xxh64 (an older node)
        lease = meta.get("lease")
        inlined = meta.get("inl") or [False] * n
        if not isinstance(lease, int) or len(inlined) != n:
            raise errors.ProtocolError(f"LOOKUP answer has lease {lease!r} and {len(inlined)} inline flags")
        inline_bytes = 0
        any_inline = False
        values = self.result.values
        for j, size in enumerate(lens):
            if size < 0:
                values[self.lo + j] = None  # also over an earlier attempt's answer
            elif inlined[j]:
                inline_bytes += size
                any_inline = True
        if inline_bytes != payload_len:
            raise errors.ProtocolError(f"LOOKUP answer payload is {payload_len} bytes, not its inline values")
        bad_leased: list[int] = []
        try:
            bad = self._read_inline(conn, lens, sums, kinds, inlined) if any_inline else []
            if lease:
                leased = [-1 if inl else size for size, inl in zip(lens, inlined)]
                arena = _arena(conn)
                arena.check_answer(meta)
                checked = meta.get("vf")  # absent (an older node): it checked every value at COMMIT
                unchecked = isinstance(checked, list) and not all(
                    checked[j] for j, size in enumerate(leased) if size >= 0 and j < len(checked)
                )
                bad_leased = self._read_leased(arena, offsets, leased, sums, kinds, unchecked)
        finally:
            if lease:  # the bad ones' offsets: the node checks them itself and removes them
                conn.send([release_frame(lease, [offsets[j] for j in bad_leased])])
        for j in bad + bad_leased:
            self.result.bad_checksum.append(self.lo + j)
            values[self.lo + j] = None

    def _dest(self, j: int, size: int):
        """Where value j (of `size` bytes, -1: a miss) goes; None: nowhere (a miss, or
        too large for its target: never write past a caller's buffer)."""
        if self.targets is None:  # cannot happen: called for reads into targets only
            raise RuntimeError("invariant broken: called for reads into targets only")
        out = self.result.values
        if size < 0:
            out[self.lo + j] = None
            return None
        target = self.targets[j]
        if size > len(target):
            out[self.lo + j] = None
            self.result.too_small.append((self.lo + j, size))
            return None
        out[self.lo + j] = size
        return target

    def _read_inline(self, conn, lens, sums, kinds, inlined) -> list[int]:
        """The values that came in the payload, in key order (as GET_BATCH sends them)."""
        out = self.result.values
        checked = []
        for j, (size, inl) in enumerate(zip(lens, inlined)):
            if not inl or size < 0:
                continue
            if self.targets is None:
                out[self.lo + j] = conn.read_bytes(size)
                checked.append((j, out[self.lo + j]))
                continue
            dest = self._dest(j, size)
            if dest is None:
                conn.skip(size)
            else:
                conn.read_into(dest[:size])
                checked.append((j, dest[:size]))
        if not self.verify:
            return []  # sent under a lease, as GET_BATCH's values are
        bad = verify_views(
            [v for _, v in checked], [sums[j] for j, _ in checked], [kinds[j] for j, _ in checked] if kinds else []
        )
        return [checked[k][0] for k in bad]

    def _read_leased(self, arena: Arena, offsets, leased, sums, kinds, unchecked: bool) -> list[int]:
        """The leased values (size >= 0 in `leased`), copied out of the arena; hashed in
        the same pass when any is `unchecked` by the node (or with verify_checksums).
        Returns the indices whose bytes did not match (not hits)."""
        trusted_until = self.sent_at + arena.lease_s * LEASE_TRUST
        hash_now = self.verify or unchecked
        if self.targets is None:
            values, bad = arena.read_values(offsets, leased, sums, hash_now, kinds)
            for j, value in enumerate(values):
                if leased[j] >= 0:
                    self.result.values[self.lo + j] = value
        else:
            dests = [self._dest(j, size) if size >= 0 else None for j, size in enumerate(leased)]
            bad = arena.read_into(offsets, leased, sums, dests, hash_now, kinds)
            values = [d if d is None else d[:n] for d, n in zip(dests, leased)]
        if not hash_now and time.monotonic() > trusted_until:
            # The lease may have ended mid-copy: those bytes must prove themselves.
            bad = verify_views([v if leased[j] >= 0 else None for j, v in enumerate(values)], sums, kinds)
        return list(bad)

    def read_values(self, conn, lens, sums, payload_len):  # not used: on_response reads
        raise NotImplementedError


class ReserveOp(Operation):
    """PUT through the arena, first half: RESERVE, write the reserved blocks, then a CommitOp."""

    opcode = Opcode.RESERVE

    def __init__(self, result: BatchResult, lo: int, hi: int, values: list, first: bool = True, last: bool = True):
        super().__init__(result, lo, hi)
        self.values = values  # byte views for keys lo..hi-1
        self.first = first  # a batch in several RESERVEs is one chain for the eviction policy
        self.last = last
        self.commit: CommitOp | None = None

    def request_meta_bytes(self, epoch):
        meta = {"keys": self.keys, "lens": [len(v) for v in self.values], "cont": not self.first, "last": self.last}
        if self.result.worth is not None:  # kept with the reservation until its COMMIT
            meta["worth"] = worth_field(self.result.worth[self.lo : self.hi])
        return encode_request_meta(meta, epoch)

    def on_response(self, conn, meta, payload_len):
        n = self.hi - self.lo
        statuses = _expect_list(meta, "st", n)
        offsets = _expect_list(meta, "offs", n)
        res = meta.get("res")
        if not isinstance(res, int) or payload_len:
            raise errors.ProtocolError(f"RESERVE answer has res {res!r} and payload {payload_len}")
        if statuses.count(PutStatus.STORED) == n:  # every key reserved: the common case
            write_at = list(offsets)
            self.result.values[self.lo : self.hi] = [False] * n
        else:
            write_at = [-1] * n
            for j, st in enumerate(statuses):
                if st == PutStatus.STORED:  # reserved: written now, stored once COMMIT says so
                    write_at[j] = offsets[j]
                    self.result.values[self.lo + j] = False
                else:
                    record_put_status(self.result, self.lo + j, st)
        if not res:
            return
        arena = _arena(conn)
        arena.check_answer(meta)
        sums = arena.write_from(write_at, self.values)  # hashed with arena.put_kind while copied
        self.commit = CommitOp(self.result, self.lo, self.hi, res, sums, write_at, arena.put_kind)

    def follow_ups(self):
        return [self.commit] if self.commit is not None else None


class CommitOp(Operation):
    """PUT through the arena, second half: publish the blocks written with their sums
    (the node does not read them again: readers check; the reservation's epoch
    decides staleness)."""

    opcode = Opcode.COMMIT

    def __init__(self, result, lo, hi, res: int, sums: list[int], written: list[int], kind: int = 0):
        super().__init__(result, lo, hi)
        self.res = res
        self.sums = sums
        self.kind = kind  # of the sums (ChecksumKind); 0 (xxh64) goes without "ck", as older clients send it
        self.written = written  # offset per key, -1 where nothing was reserved

    def request_meta_bytes(self, epoch):
        if self.kind == ChecksumKind.XXH64:
            return encode_meta({"res": self.res, "sums": self.sums})
        return encode_meta({"res": self.res, "sums": self.sums, "ck": int(self.kind)})

    def on_response(self, conn, meta, payload_len):
        statuses = _expect_list(meta, "st", self.hi - self.lo)
        conn.skip(payload_len)
        if -1 not in self.written:  # every key was reserved
            record_put_statuses(self.result, self.lo, statuses)
            return
        for j, st in enumerate(statuses):
            if self.written[j] >= 0:  # the others were answered by the RESERVE
                record_put_status(self.result, self.lo + j, st)


def lookup_ops(result, slices, targets, verify: bool):
    return [LookupOp(result, lo, hi, None if targets is None else targets[lo:hi], verify) for lo, hi in slices]


def reserve_ops(result, slices, views):
    last = len(slices) - 1
    return [ReserveOp(result, lo, hi, views[lo:hi], first=k == 0, last=k == last) for k, (lo, hi) in enumerate(slices)]
