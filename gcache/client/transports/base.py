"""The transport seam: how a Client reaches one gcache-server and moves value bytes.

Contract every transport keeps (the Client's methods behave the same on each):
- `connect()` opens a framed stream (a `Connection`) on which every request of
  docs/protocol.md can be sent; the Client's pool owns and closes it. A failure
  raises gcache.errors.ConnectionError (retried by the Client) or another
  GCacheError (not retried).
- `get_ops` / `put_ops` build the operations for slices of one batch. Run on a
  connection from `connect()`, they fill the shared BatchResult exactly as
  GET_BATCH / PUT_BATCH would: a value is a hit only with every byte verified
  against its checksum where the transport copies it itself (shm, rdma), misses
  are None, puts answer True / False, per-key problems go into the result.
- Every operation is idempotent, so the Client may re-run all of a call's
  operations on a fresh connection after a connection failure; anything a
  transport holds on the server (leases, reservations) dies with its connection.
- `pipeline_depth` caps the frames one call keeps in flight (None: the Client's);
  `put_chunk_bytes` caps the value bytes of one put frame (None: the Client's).
- `close()` releases what the transport itself holds (mappings, registered
  memory); it is called after the pool closed its connections.

Implementations: TcpTransport (here), ShmTransport (gcache.client.transports.shm),
RdmaTransport (gcache.client.transports.rdma); `open_transport`
(gcache.client.transports.choose) picks one.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from gcache.client.connection import Connection
from gcache.client.operations import BatchResult, GetIntoOp, GetOp, Operation, PutOp
from gcache.wire.protocol import ChecksumKind, checksum_kinds_of

CHECKSUM_ENV = "GCACHE_CHECKSUM"  # "xxh64": write with the old checksum (nodes from before XXH3)


def put_checksum_kind(node_meta: dict | None = None) -> ChecksumKind:
    """The checksum new values are written with: XXH3, unless $GCACHE_CHECKSUM is
    "xxh64" or the node's PING / SHM_ATTACH / RDMA_CONNECT answer (`node_meta`) says
    it speaks only xxh64."""
    if os.environ.get(CHECKSUM_ENV, "").strip().lower() == "xxh64":
        return ChecksumKind.XXH64
    if node_meta is not None and ChecksumKind.XXH3 not in checksum_kinds_of(node_meta):
        return ChecksumKind.XXH64
    return ChecksumKind.XXH3


PUT_CHUNK_BYTES_MAX = 8 << 20
PUT_CHUNK_BYTES_MIN = 64 << 10


def put_chunk_for(reserve_bytes_max: int) -> int:
    """One-sided put chunk: two (one being written, one being committed) fit what one
    connection may hold reserved, within [64 KiB, 8 MiB]."""
    return max(PUT_CHUNK_BYTES_MIN, min(PUT_CHUNK_BYTES_MAX, reserve_bytes_max // 2))


class Transport(ABC):
    name: str = ""
    pipeline_depth: int | None = None
    put_chunk_bytes: int | None = None  # a put batch is split into frames of at most this many bytes

    def __init__(self, address: str):
        self.address = address  # the server's TCP address: the client's name for it

    @abstractmethod
    def connect(self) -> Connection:
        """A new framed stream to the server."""

    @abstractmethod
    def get_ops(
        self, result: BatchResult, slices: list[tuple[int, int]], verify: bool, targets: list | None
    ) -> list[Operation]:
        """Operations reading keys [lo, hi) of each slice: into `targets` (one byte
        view per key of the batch) or, with None, as new bytes objects."""

    @abstractmethod
    def put_ops(self, result: BatchResult, slices: list[tuple[int, int]], views: list) -> list[Operation]:
        """Operations storing views[i] under result.keys[i] for every slice."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return self.name


class TcpTransport(Transport):
    """Values travel in the frames (GET_BATCH / PUT_BATCH) over TCP."""

    name = "tcp"

    def __init__(self, address: str, timeout_s: float, connect_timeout_s: float, token: str | None):
        super().__init__(address)
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._token = token
        # Over TCP nothing is asked first: a node from before XXH3 refuses the first
        # PUT with a clear error (PutOp.explain_error); GCACHE_CHECKSUM=xxh64 talks to it.
        self.put_kind = put_checksum_kind()

    def connect(self) -> Connection:
        return Connection(self.address, self._timeout_s, self._connect_timeout_s, self._token)

    def get_ops(self, result, slices, verify, targets):
        if targets is None:
            return [GetOp(result, lo, hi, verify) for lo, hi in slices]
        return [GetIntoOp(result, lo, hi, verify, targets[lo:hi]) for lo, hi in slices]

    def put_ops(self, result, slices, views):
        return [PutOp(result, lo, hi, views[lo:hi], self.put_kind) for lo, hi in slices]
