"""The same-host transport: the server's arena mapped into this process.

Connections go to the server's Unix socket (PING names it). The first one
asks for the arena with SHM_ATTACH and receives its memfd (SCM_RIGHTS); the
mapping is shared by every connection to that server instance, and a
connection to a restarted server (another instance) maps the new arena.
Reads and writes copy between the mapping and the caller's buffers natively
(gcache._native.shm_*: GIL released, several threads for large batches,
each value's checksum computed in the same pass).
"""

from __future__ import annotations

import mmap
import os
import threading
from contextlib import contextmanager

from gcache import errors
from gcache._native import shm_read_into, shm_read_scatter, shm_read_values, shm_write_from
from gcache.client import pipeline
from gcache.client.arena import Arena
from gcache.client.connection import Connection
from gcache.client.native_core import native_arena
from gcache.client.operations import BatchResult, MetaOp
from gcache.client.transports.base import PUT_CHUNK_BYTES_MAX, Transport, put_checksum_kind, put_chunk_for
from gcache.client.transports.shm_ops import lookup_ops, reserve_ops
from gcache.wire.protocol import FLAG_RESPONSE, ChecksumKind, FrameStatus, Opcode, encode_header

_EMPTY_MAP = b"\x80"  # msgpack {}
# Asking the TCP port where the Unix socket is must not hold a caller up for long.
DISCOVERY_TIMEOUT_S_MAX = 2.0


def discover(address: str, timeout_s: float, connect_timeout_s: float) -> tuple[str | None, str | None]:
    """(Unix socket path, server instance) from the server's PING over TCP; the path
    is None when it offers none (no --unix-socket, or --auth-file)."""
    conn = Connection(address, min(timeout_s, DISCOVERY_TIMEOUT_S_MAX), connect_timeout_s)
    try:
        result = BatchResult([])
        pipeline.run(conn, [MetaOp(Opcode.PING, result)], 1)
    finally:
        conn.close()
    if result.meta is None:  # cannot happen: MetaOp read the answer's map
        raise RuntimeError("invariant broken: MetaOp read the answer's map")
    path, instance = result.meta.get("unix"), result.meta.get("instance")
    return (path if isinstance(path, str) and path else None, instance if isinstance(instance, str) else None)


class MappedArena(Arena):
    """A server's arena, mapped read-write (a put writes its reserved blocks).

    Copies run while other threads may close the client (a ClusterClient closes a
    node's Client once the node dies or leaves the map): every copy holds the
    mapping (`_use`), close() only marks it closing, and the last copy out
    unmaps it. A copy that starts after close() raises ClientClosedError (the
    cluster client retries the keys by its newer map), never mmap's ValueError.
    """

    def __init__(
        self, fd: int, size: int, instance: str, lease_s: float, threads: int = 0, put_kind: int = ChecksumKind.XXH3
    ):
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.native = native_arena(fd, size)  # the native core's mapping (None without the core)
        self.size = size
        self.instance = instance
        self.lease_s = lease_s  # how long a LOOKUP lease lasts on the server
        self.threads = threads  # copy threads per call; 0 = by size (1 per MiB, at most the cores)
        self._lock = threading.Lock()
        self._users = 0  # copies running on the mapping
        self._closing = False
        self.put_kind = put_kind  # the checksum written values get (what the node speaks)

    def check_answer(self, meta: dict) -> None:
        """Where an answer's offsets point is this mapping: nothing to check."""

    @contextmanager
    def _use(self):
        with self._lock:
            if self._closing:
                raise errors.ClientClosedError(
                    f"the arena mapping of gcache-server instance {self.instance} was closed "
                    "(its client closed, or the node left the cluster map)"
                )
            self._users += 1
        try:
            yield self.map
        except ValueError as exc:  # a block outside the mapping: the answer is wrong
            raise errors.ProtocolError(f"gcache-server instance {self.instance}: {exc}") from None
        finally:
            with self._lock:
                self._users -= 1
                last = self._closing and self._users == 0
            if last:
                self._unmap()

    def read_into(self, offsets, lens, sums, dests, verify: bool, kinds=()) -> list[int]:
        with self._use() as arena:
            return shm_read_into(arena, offsets, lens, sums, dests, self.threads, verify, list(kinds))

    def read_scatter(self, offsets, lens, sums, kinds, first, dst, at, run_lens, verify: bool) -> list[int]:
        """Each value (lens[i] >= 0) into its runs (client/scatter.py), checked before copied;
        the indices that failed their checksum."""
        with self._use() as arena:
            return shm_read_scatter(arena, offsets, lens, sums, list(kinds), first, dst, at, run_lens, verify)

    def read_values(self, offsets, lens, sums, verify: bool, kinds=()):
        with self._use() as arena:
            return shm_read_values(arena, offsets, lens, sums, self.threads, verify, list(kinds))

    def write_from(self, offsets, views) -> list[int]:
        with self._use() as arena:
            return shm_write_from(arena, offsets, views, self.threads, int(self.put_kind))

    def close(self) -> None:
        """Unmaps now if no copy runs, else when the last one ends."""
        with self._lock:
            self._closing = True
            idle = self._users == 0
        if self.native is not None:
            self.native.close()  # later native copies raise; unmapped when its last holder lets go
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view of the mapping is still exported: the GC unmaps it
            pass


def attach(conn: Connection) -> tuple[int, dict]:
    """SHM_ATTACH on a fresh connection: (memfd, its answer: arena_bytes, instance,
    reserve_bytes_max).
    TransportUnavailableError when the server refuses (auth on, not its Unix socket)."""
    request_id = next(pipeline._request_ids)
    conn.send([encode_header(Opcode.SHM_ATTACH, request_id, len(_EMPTY_MAP), 0) + _EMPTY_MAP])
    fd = conn.receive_with_fd()
    try:
        opcode, flags, rid, meta_len, status, payload_len = conn.read_header()
        meta = conn.read_meta(meta_len)
        if status != FrameStatus.OK:
            error = pipeline.status_error(status, meta, conn.address)
            raise errors.TransportUnavailableError(f"shared memory refused: {error}")
        if rid != request_id or opcode != Opcode.SHM_ATTACH or not flags & FLAG_RESPONSE or payload_len:
            raise errors.ProtocolError(f"gcache-server at {conn.address} answered SHM_ATTACH out of order")
        size, instance, reserve = meta.get("arena_bytes"), meta.get("instance"), meta.get("reserve_bytes_max")
        lease_ms = meta.get("lease_ms")
        if (
            fd is None
            or not isinstance(size, int)
            or size <= 0
            or not isinstance(instance, str)
            or not isinstance(reserve, int)
            or reserve <= 0
            or not isinstance(lease_ms, int)
        ):
            raise errors.ProtocolError(
                f"gcache-server at {conn.address} answered SHM_ATTACH without an arena ({meta!r})"
            )
    except BaseException:
        if fd is not None:
            os.close(fd)
        conn.broken = True
        raise
    return fd, meta


class ShmTransport(Transport):
    name = "shm"
    # A put keeps at most two RESERVEs' blocks at once: the server's reservation
    # budget is per client process, and blocks are held until their COMMIT.
    pipeline_depth = 2
    # Put chunks: the COMMIT of one overlaps the copy of the next, and two fit what
    # one connection may hold reserved (the server says how much at attach).
    put_chunk_bytes = PUT_CHUNK_BYTES_MAX

    def __init__(
        self,
        address: str,
        unix_path: str,
        timeout_s: float,
        connect_timeout_s: float,
        expected_instance: str | None = None,
        copy_threads: int = 0,
    ):
        super().__init__(address)
        self.unix_path = unix_path
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._expected_instance = expected_instance  # from the TCP PING: the socket must lead there
        self._copy_threads = copy_threads
        self._lock = threading.Lock()
        self._arena: MappedArena | None = None

    def connect(self) -> Connection:
        try:
            conn = Connection(self.address, self._timeout_s, self._connect_timeout_s, unix_path=self.unix_path)
        except errors.ConnectionError:
            # A server restarted with another --unix-socket (or data dir) still
            # answers PING on its TCP port with the new path.
            path, _ = discover(self.address, self._timeout_s, self._connect_timeout_s)
            if path is None or path == self.unix_path:
                raise
            self.unix_path = path
            conn = Connection(self.address, self._timeout_s, self._connect_timeout_s, unix_path=path)
        try:
            fd, meta = attach(conn)
            try:
                conn.arena = self._arena_for(
                    fd, meta["arena_bytes"], meta["instance"], meta["lease_ms"] / 1000, put_checksum_kind(meta)
                )
            finally:
                os.close(fd)
            self.put_chunk_bytes = put_chunk_for(meta["reserve_bytes_max"])
        except BaseException:
            conn.close()
            raise
        return conn

    def _arena_for(self, fd: int, size: int, instance: str, lease_s: float, put_kind: int) -> MappedArena:
        with self._lock:
            if self._expected_instance is not None and instance != self._expected_instance:
                raise errors.TransportUnavailableError(
                    f"the Unix socket {self.unix_path} leads to another gcache-server than "
                    f"{self.address}; use transport='tcp'"
                )
            self._expected_instance = None  # checked once: later a restarted server may answer
            if self._arena is None or self._arena.instance != instance:
                # Connections to an older instance keep its mapping until they die.
                self._arena = MappedArena(fd, size, instance, lease_s, self._copy_threads, put_kind)
            return self._arena

    def get_ops(self, result, slices, verify, targets):
        return lookup_ops(result, slices, targets, verify)

    def put_ops(self, result, slices, views):
        return reserve_ops(result, slices, views)

    def close(self) -> None:
        with self._lock:
            arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()

    def describe(self) -> str:
        return f"shm via {self.unix_path}"
