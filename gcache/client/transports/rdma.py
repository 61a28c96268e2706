"""Transport "rdma": the same one-sided protocol as shm, with RDMA as the copy.

Every connection is a TCP connection plus its own RC queue pair, set up by
one RDMA_CONNECT exchange on that connection (docs/protocol.md, "RDMA").
Reads and writes are LOOKUP / RESERVE + COMMIT exactly as over shared memory
(gcache.client.transports.shm_ops); only `conn.arena` differs: an RdmaArena posts RDMA
READs from the server's registered arena into a registered staging buffer
(WRITEs the other way), then the native copy loop of the shm transport moves
the bytes between staging and the caller's buffers and verifies every value's
checksum in the same pass. A value is never returned unless its bytes match.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

from gcache import errors
from gcache._native import shm_read_into, shm_read_values, shm_write_from
from gcache.client import pipeline
from gcache.client.arena import Arena
from gcache.client.connection import BULK_READ_BYTES_PER_S_MIN, Connection
from gcache.client.transports.base import PUT_CHUNK_BYTES_MAX, Transport, put_checksum_kind, put_chunk_for
from gcache.client.transports.shm_ops import lookup_ops, reserve_ops
from gcache.wire import rdma_verbs
from gcache.wire.protocol import FLAG_RESPONSE, FrameStatus, Opcode, encode_header, encode_meta

STAGING_BYTES = 16 << 20  # per connection; a batch larger than this moves in rounds
STAGING_BYTES_MAX = 1 << 32  # grown only for one value larger than the staging buffer
QUEUE_DEPTH = 64  # work requests in flight per queue pair
STAGING_ALIGN = 64
_IDLE_POLLS_BEFORE_SLEEP = 200
_POLL_SLEEP_S = 50e-6


def _aligned(n: int) -> int:
    return (n + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN


class _Staging:
    """An anonymous mapping registered for local RDMA access (READs land here)."""

    def __init__(self, device, size: int):
        self.size = size
        self.map = mmap.mmap(-1, size)
        try:
            probe = ctypes.c_char.from_buffer(self.map)
            self.addr = ctypes.addressof(probe)
            del probe  # its export would keep the mapping from closing
            self.mr = device.register(self.addr, size, remote=False)
        except BaseException:
            self.map.close()
            raise

    def close(self) -> None:
        self.mr.close()
        self.map.close()


class RdmaArena(Arena):
    """A server's registered arena through one queue pair, with the MappedArena interface.

    Every value read is checked against its checksum while it is copied out of staging
    (the `verify` argument notwithstanding), as the shm transport checks every leased
    value: a COMMIT publishes a writer's declared sums unread. `lease_s` is infinite."""

    lease_s = float("inf")

    def __init__(
        self,
        device,
        qp,
        address: str,
        addr: int,
        rkey: int,
        size: int,
        timeout_s: float,
        staging_bytes: int = STAGING_BYTES,
        put_kind: int = 0,
    ):
        self.address = address  # the server's, for messages
        self.size = size
        self._device = device
        self._qp = qp
        self._remote = (addr, rkey)
        self._timeout_s = timeout_s
        self._staging = _Staging(device, staging_bytes)
        self.put_kind = put_kind  # the checksum written values get (what the node speaks)

    # -- the MappedArena interface (gcache.client.transports.shm_ops) ---------------------

    def check_answer(self, meta: dict) -> None:
        """The arena's remote address and rkey from a LOOKUP / RESERVE answer."""
        addr, rkey = meta.get("addr"), meta.get("rkey")
        if not isinstance(addr, int) or not isinstance(rkey, int) or not rkey:
            raise errors.ProtocolError(
                f"gcache-server at {self.address} answered without its RDMA region (addr {addr!r}, rkey "
                f"{rkey!r}): it stopped offering RDMA; reconnect, or use transport='tcp'"
            )
        self._remote = (addr, rkey)

    def read_into(self, offsets, lens, sums, dests, verify: bool = True, kinds=()) -> list[int]:
        wanted = [i for i, d in enumerate(dests) if d is not None and lens[i] >= 0]
        bad: list[int] = []
        for batch, local in self._read_rounds(offsets, lens, wanted, bad):
            bad.extend(
                batch[j]
                for j in shm_read_into(
                    self._staging.map,
                    local,
                    [lens[i] for i in batch],
                    [sums[i] for i in batch],
                    [dests[i] for i in batch],
                    kinds=[kinds[i] for i in batch] if kinds else [],
                )
            )
        return sorted(bad)

    def read_values(self, offsets, lens, sums, verify: bool = True, kinds=()):
        values = [None] * len(lens)
        bad: list[int] = []
        for batch, local in self._read_rounds(offsets, lens, [i for i, n in enumerate(lens) if n >= 0], bad):
            got, failed = shm_read_values(
                self._staging.map,
                local,
                [lens[i] for i in batch],
                [sums[i] for i in batch],
                kinds=[kinds[i] for i in batch] if kinds else [],
            )
            for j, i in enumerate(batch):
                values[i] = got[j]
            bad.extend(batch[j] for j in failed)
        return values, sorted(bad)

    def write_from(self, offsets, views) -> list[int]:
        sums = [0] * len(views)
        wanted = []
        for i, off in enumerate(offsets):
            if off < 0:
                continue
            if not 0 <= off <= self.size - len(views[i]):
                raise errors.ProtocolError(
                    f"gcache-server at {self.address} reserved a block outside its arena "
                    f"(offset {off}, {len(views[i])} bytes, arena {self.size})"
                )
            wanted.append(i)
        for batch, local in self._rounds(wanted, [len(v) for v in views]):
            written = shm_write_from(self._staging.map, local, [views[i] for i in batch], kind=int(self.put_kind))
            self._transfer(True, [(local[j], offsets[i], len(views[i])) for j, i in enumerate(batch)])
            for j, i in enumerate(batch):
                sums[i] = written[j]
        return sums

    def close(self) -> None:
        self._qp.close()
        self._staging.close()

    # -- rounds through the staging buffer ------------------------------------

    def _read_rounds(self, offsets, lens, wanted, bad):
        """READs for `wanted`, round by round; yields (indices, staging offsets) once landed.
        A block outside the arena is not read: its index goes to `bad`."""
        inside = []
        for i in wanted:
            if 0 <= offsets[i] and lens[i] <= self.size - offsets[i]:
                inside.append(i)
            else:
                bad.append(i)
        for batch, local in self._rounds(inside, lens):
            self._transfer(False, [(local[j], offsets[i], lens[i]) for j, i in enumerate(batch)])
            yield batch, local

    def _rounds(self, indices, lens):
        """Groups of indices whose values fit the staging buffer together, with their staging offsets."""
        batch: list[int] = []
        local: list[int] = []
        used = 0
        for i in indices:
            size = _aligned(lens[i])
            if used + size > self._staging.size and batch:
                yield batch, local
                batch, local, used = [], [], 0
            if size > self._staging.size:
                self._grow(size)
            batch.append(i)
            local.append(used)
            used += size
        if batch:
            yield batch, local

    def _grow(self, size: int) -> None:
        if size > STAGING_BYTES_MAX:
            raise errors.ProtocolError(
                f"a value of {size} bytes is larger than the RDMA staging limit "
                f"({STAGING_BYTES_MAX}); use transport='tcp'"
            )
        new_size = self._staging.size
        while new_size < size:
            new_size *= 2
        staging = _Staging(self._device, min(new_size, STAGING_BYTES_MAX))
        self._staging.close()
        self._staging = staging

    def _transfer(self, write: bool, items: list[tuple[int, int, int]]) -> None:
        """Posts one READ (or WRITE) per (staging offset, arena offset, length) and waits for all."""
        items = [item for item in items if item[2] > 0]  # nothing to move for an empty value
        if not items:
            return
        addr, rkey = self._remote
        total = sum(n for _, _, n in items)
        allowed_s = self._timeout_s + total / BULK_READ_BYTES_PER_S_MIN
        deadline = time.monotonic() + allowed_s
        base, lkey = self._staging.addr, self._staging.mr.lkey
        depth = max(1, self._qp.depth)
        posted = done = idle = 0
        what = "WRITE" if write else "READ"
        try:
            while done < len(items):
                while posted < len(items) and posted - done < depth:
                    local, remote, length = items[posted]
                    self._qp.post(write, base + local, lkey, addr + remote, rkey, length, posted)
                    posted += 1
                completions = self._qp.poll(posted - done)
                for wr_id, status in completions:
                    if status != 0:
                        raise errors.ConnectionError(
                            f"RDMA {what} of {items[wr_id][2]} bytes from gcache-server at {self.address} "
                            f"failed (work completion status {status}); the queue pair is unusable, "
                            "the client reconnects",
                            self.address,
                        )
                done += len(completions)
                if completions:
                    idle = 0
                    continue
                if time.monotonic() > deadline:
                    raise errors.TimeoutError(
                        f"RDMA {what}s of {total} bytes with gcache-server at {self.address} did not complete "
                        f"within {allowed_s:.1f}s",
                        self.address,
                    )
                idle += 1
                if idle >= _IDLE_POLLS_BEFORE_SLEEP:  # let other threads run (the GIL)
                    time.sleep(_POLL_SLEEP_S)
        except errors.GCacheError:
            raise
        except Exception as exc:  # pyverbs errors: posting or polling failed
            raise errors.ConnectionError(
                f"RDMA {what} with gcache-server at {self.address} failed: {exc}", self.address
            ) from exc


class RdmaConnection(Connection):
    """A TCP connection whose queue pair and staging buffer die with it."""

    def close(self) -> None:
        super().close()
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.close()


def rdma_connect(conn: Connection, endpoint: dict) -> dict:
    """RDMA_CONNECT: this side's endpoint out, the server's (with addr, rkey, arena_bytes) back.
    TransportUnavailableError when the server offers no RDMA."""
    request_id = next(pipeline._request_ids)
    meta = encode_meta(endpoint)
    conn.send([encode_header(Opcode.RDMA_CONNECT, request_id, len(meta), 0) + meta])
    opcode, flags, rid, meta_len, status, payload_len = conn.read_header()
    answer = conn.read_meta(meta_len)
    if status in (FrameStatus.FORBIDDEN, FrameStatus.UNKNOWN_OPCODE):  # no RDMA there (or an older server)
        error = pipeline.status_error(status, answer, conn.address)
        raise errors.TransportUnavailableError(f"gcache-server at {conn.address} refused RDMA: {error}")
    if status != FrameStatus.OK:
        conn.broken = True
        raise pipeline.status_error(status, answer, conn.address)
    if rid != request_id or opcode != Opcode.RDMA_CONNECT or not flags & FLAG_RESPONSE or payload_len:
        conn.broken = True
        raise errors.ProtocolError(f"gcache-server at {conn.address} answered RDMA_CONNECT out of order")
    for name in ("addr", "rkey", "arena_bytes", "reserve_bytes_max"):
        if not isinstance(answer.get(name), int) or answer[name] <= 0:
            conn.broken = True
            raise errors.ProtocolError(
                f"gcache-server at {conn.address} answered RDMA_CONNECT without {name!r} ({answer!r})"
            )
    return answer


class RdmaTransport(Transport):
    name = "rdma"
    # As shm: a put keeps at most two RESERVEs' blocks at once, COMMIT of one
    # chunk overlapping the WRITEs of the next; two chunks fit what the server
    # lets one connection hold reserved (its RDMA_CONNECT answer says how much).
    pipeline_depth = 2
    put_chunk_bytes = PUT_CHUNK_BYTES_MAX

    def __init__(
        self,
        address: str,
        timeout_s: float,
        connect_timeout_s: float,
        token: str | None,
        device=None,
        staging_bytes: int | None = None,
    ):
        """`device`: an opened rdma_verbs.Device (default: $GCACHE_RDMA_DEVICE, else the
        host's first). TransportUnavailableError saying why when RDMA cannot work."""
        super().__init__(address)
        if token:
            raise errors.TransportUnavailableError(
                "RDMA is off with authentication: the registered arena holds every tenant's values"
            )
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._staging_bytes = STAGING_BYTES if staging_bytes is None else staging_bytes
        if device is None:
            try:
                device = rdma_verbs.Device(rdma_verbs.load(), os.environ.get(rdma_verbs.RDMA_DEVICE_ENV) or None)
            except rdma_verbs.RdmaUnavailable as exc:
                raise errors.TransportUnavailableError(f"RDMA is not usable here: {exc}") from exc
        self._device = device

    def connect(self) -> Connection:
        conn = RdmaConnection(self.address, self._timeout_s, self._connect_timeout_s)
        try:
            qp = self._device.queue_pair(QUEUE_DEPTH)
            try:
                answer = rdma_connect(conn, qp.endpoint())
                try:
                    qp.connect(rdma_verbs.parse_endpoint(answer))
                except ValueError as exc:
                    raise errors.ProtocolError(f"gcache-server at {self.address}: {exc}") from exc
                conn.arena = RdmaArena(
                    self._device,
                    qp,
                    self.address,
                    answer["addr"],
                    answer["rkey"],
                    answer["arena_bytes"],
                    self._timeout_s,
                    self._staging_bytes,
                    put_checksum_kind(answer),
                )
                self.put_chunk_bytes = put_chunk_for(answer["reserve_bytes_max"])
            except BaseException:
                qp.close()
                raise
        except BaseException:
            conn.close()
            raise
        return conn

    def get_ops(self, result, slices, verify, targets):
        return lookup_ops(result, slices, targets, verify)  # RdmaArena verifies every value

    def put_ops(self, result, slices, views):
        return reserve_ops(result, slices, views)

    def close(self) -> None:
        self._device.close()

    def describe(self) -> str:
        return f"rdma via {getattr(self._device, 'name', 'device')}"
