"""A raw client of the one-sided opcodes for tests (docs/protocol.md, "Shared memory
and RDMA"): frames by hand over the server's Unix socket, the arena mapped with mmap.
Independent of gcache.client, so the tests check the wire contract itself."""

from __future__ import annotations

import mmap
import os
import socket

from gcache.wire.protocol import FLAG_NO_REPLY
from tests.support.raw_protocol import (  # noqa: F401 (theirs to import)
    COMMIT,
    FORBIDDEN,
    LOOKUP,
    RELEASE,
    RESERVE,
    SHM_ATTACH,
    RawConnection,
    frame_bytes,
)


class RawShm(RawConnection):
    """RawConnection over a Unix socket, plus SHM_ATTACH (the arena, mapped)."""

    def __init__(self, path: str, timeout_s: float = 20.0):  # not super().__init__: that opens TCP
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self._next_id = 1
        self.arena: mmap.mmap | None = None

    def attach(self) -> dict:
        rid = self._next_id
        self._next_id += 1
        self.send(frame_bytes(SHM_ATTACH, {}, b"", rid))
        data, fds, _, _ = socket.recv_fds(self.sock, 65536, 1)
        assert len(fds) == 1, "SHM_ATTACH passes exactly one descriptor"
        self._pending = data
        try:
            frame = self.recv_frame()
            self.arena = mmap.mmap(fds[0], frame.meta["arena_bytes"])
        finally:
            os.close(fds[0])
        return frame.meta

    def recv_exact(self, n: int) -> bytes:
        pending = getattr(self, "_pending", b"")
        if pending:
            take, self._pending = pending[:n], pending[n:]
            return take + (super().recv_exact(n - len(take)) if len(take) < n else b"")
        return super().recv_exact(n)

    def release(self, leases=(), reservations=(), no_reply: bool = True):
        meta = {"leases": list(leases), "reservations": list(reservations)}
        if no_reply:
            self.send(frame_bytes(RELEASE, meta, flags=FLAG_NO_REPLY))
            return None
        return self.request(RELEASE, meta)
