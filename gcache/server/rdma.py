"""The node's side of transport "rdma" (`--rdma-device NAME`, docs/protocol.md, "RDMA").

The arena is registered with the device once; from then on every LOOKUP and
RESERVE answer carries its remote address and rkey (Server.set_rdma_region).
A client sets up its queue pair over its TCP connection with RDMA_CONNECT:
the native server hands the request to `RdmaRegion.__call__` (on that
connection's thread), which makes this side's queue pair, connects it to the
client's and answers with its own endpoint; `closed()` destroys it when the
connection ends. The CPU does nothing per value: clients READ and WRITE the
registered arena one-sided, and COMMIT still verifies every written checksum.
"""

from __future__ import annotations

import logging
import threading

from gcache.errors import ProtocolError
from gcache.wire import rdma_verbs
from gcache.wire.protocol import decode_meta, encode_meta

log = logging.getLogger("gcache.server")

# This side posts nothing: its queue pairs only answer the clients' READs and WRITEs.
SERVER_QP_DEPTH = 1


def open_device(name: str) -> rdma_verbs.Device:
    """The device for --rdma-device; RdmaUnavailable (pyverbs or the device missing)."""
    return rdma_verbs.Device(rdma_verbs.load(), name)


class RdmaRegion:
    """The registered arena and one queue pair per client connection that asked."""

    def __init__(self, native, device: rdma_verbs.Device):
        self._native = native
        self.device = device
        self.mr = device.register(native.arena_address, native.arena_bytes, remote=True)
        self._lock = threading.Lock()
        self._qps: dict[int, rdma_verbs.QueuePair] = {}
        native.set_rdma_region(self.mr.buf, self.mr.rkey)
        native.set_rdma_connect_handler(self)
        log.info(
            "RDMA: arena of %d bytes registered with %s port %d (gid index %d)",
            native.arena_bytes,
            device.name,
            device.port,
            device.gid_index,
        )

    def __call__(self, conn_id: int, meta: bytes) -> bytes:
        """RDMA_CONNECT on connection `conn_id`: ValueError for a bad endpoint (BAD_FRAME)."""
        try:
            peer = rdma_verbs.parse_endpoint(decode_meta(meta))
        except ProtocolError as exc:
            raise ValueError(str(exc)) from exc
        try:
            qp = self.device.queue_pair(SERVER_QP_DEPTH)
        except self.device.v.PyverbsError as exc:
            raise RuntimeError(f"cannot create a queue pair on {self.device.name}: {exc}") from exc
        try:
            qp.connect(peer)
        except self.device.v.PyverbsError as exc:
            qp.close()
            raise ValueError(f"cannot connect a queue pair to the client's endpoint {peer}: {exc}") from exc
        with self._lock:
            old = self._qps.pop(conn_id, None)  # a second RDMA_CONNECT replaces the first
            self._qps[conn_id] = qp
        if old is not None:
            old.close()
        return encode_meta(
            {
                **qp.endpoint(),
                "addr": self.mr.buf,
                "rkey": self.mr.rkey,
                "arena_bytes": self._native.arena_bytes,
                "reserve_bytes_max": self._native.reserve_bytes_per_connection,
                "cks": [0, 1],  # the checksum kinds COMMIT may use (docs/protocol.md)
            }
        )

    def closed(self, conn_id: int) -> None:
        with self._lock:
            qp = self._qps.pop(conn_id, None)
        if qp is not None:
            qp.close()

    def queue_pairs(self) -> int:
        with self._lock:
            return len(self._qps)

    def close(self) -> None:
        """After the native server stopped: clients can no longer reach the arena."""
        self._native.set_rdma_connect_handler(None)
        self._native.set_rdma_region(0, 0)
        with self._lock:
            qps, self._qps = list(self._qps.values()), {}
        for qp in qps:
            qp.close()
        self.device.close()
