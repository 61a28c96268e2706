"""One connection to a gcache-server (TCP, or its Unix socket): framed sends and
buffered, zero-copy reads.

Timeouts are enforced by the kernel (SO_RCVTIMEO / SO_SNDTIMEO) on a blocking
socket, so each recv/send is one syscall instead of poll + syscall: a wait that
makes no progress for `timeout_s` raises TimeoutError. Any failure marks the
connection broken; the pool then closes it instead of reusing it.
"""

from __future__ import annotations

import builtins
import os
import socket
import struct

from gcache import errors

# One recvmsg over many buffers with the GIL released: ~2x Python's recv_into loop.
from gcache._native import recv_into_buffers as _native_recv_into_buffers

# A PUT_BATCH payload with "trail": each group of values hashed just before it is sent.
from gcache._native import send_put_hashed as _native_send_put_hashed
from gcache.client import deadline as call_deadline
from gcache.client.arena import Arena
from gcache.common.address import parse_host_port
from gcache.wire.protocol import HEADER, HEADER_BYTES, MAGIC, META_BYTES_MAX, VERSION, decode_meta

READ_BUFFER_BYTES = 64 * 1024
# Reads larger than this go straight into the caller's buffer; smaller ones are
# served from the read buffer (one recv often brings header, meta and value).
DIRECT_READ_BYTES_MIN = 16 * 1024
IOV_PER_SENDMSG_MAX = 512  # well under Linux IOV_MAX (1024)
# A bulk read gets timeout_s plus one second per this many bytes (the native
# reader takes one deadline for the whole transfer, not one per wait).
BULK_READ_BYTES_PER_S_MIN = 64 * 1024 * 1024


class HashedValues:
    """A PUT_BATCH payload with "trail": each value followed by its checksum of
    `kind` (8 bytes, little-endian), computed natively while the values are sent
    (Connection.send), so no pass over the values happens before the send."""

    __slots__ = ("values", "kind")

    def __init__(self, values: list, kind: int):
        self.values = values
        self.kind = kind

    def __len__(self) -> int:
        return sum(len(v) for v in self.values) + 8 * len(self.values)


def parse_address(address: str) -> tuple[str, int]:
    try:
        return parse_host_port(address)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"server address {address!r} must look like host:port, e.g. 127.0.0.1:7600"
        ) from None


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class Connection:
    """A blocking socket plus a small read buffer. Not thread-safe: one user at a time."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        connect_timeout_s: float,
        token: str | None = None,
        unix_path: str | None = None,
    ):
        """`address` names the server (host:port); with `unix_path` the connection
        goes to that Unix socket of the same server instead."""
        self.address = address
        self.tenant: str | None = None  # set by the AUTH handshake (None: the node has no auth)
        self.timeout_s = timeout_s
        self.broken = False
        self.reused = False  # set by the pool when handed out again after being idle
        self.arena: Arena | None = None  # what a one-sided transport (shm, rdma) moves bytes through
        self.native: object | None = None  # the native client core on this socket (gcache.client.native_core)
        # The deadline of the call using this connection (gcache.client.deadline): every
        # wait is capped by what is left of it. Set for a call, cleared by end_call().
        self.deadline = call_deadline.current()
        self._waits_capped = False  # the socket timeouts are below timeout_s (near a deadline)
        if self.deadline is not None:
            self.deadline.check(address, "connecting")
            connect_timeout_s = max(0.001, self.deadline.cap(connect_timeout_s))
        host, port = parse_address(address)
        try:
            if unix_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(connect_timeout_s)
                    sock.connect(unix_path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except ConnectionRefusedError as exc:
            raise errors.ConnectionError(
                f"cannot connect to gcache-server at {address}: connection refused; "
                "is the server running and listening on that port?",
                address,
            ) from exc
        except (socket.timeout, TimeoutError) as exc:
            raise errors.ConnectionError(
                f"cannot connect to gcache-server at {address} within {connect_timeout_s}s; "
                "check the address and that the host is reachable",
                address,
            ) from exc
        except OSError as exc:
            raise errors.ConnectionError(
                f"cannot connect to gcache-server at {unix_path or address}: {exc}", address
            ) from exc
        sock.settimeout(None)
        if unix_path is None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout_s))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))
        self.sock = sock
        self._rbuf = bytearray(READ_BUFFER_BYTES)
        self._rview = memoryview(self._rbuf)
        self._pos = 0
        self._end = 0
        if token:
            from gcache.client.auth_handshake import authenticate

            try:
                self.tenant = authenticate(self, token)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass

    # -- the call's deadline ------------------------------------------------

    def begin_call(self, deadline) -> None:
        self.deadline = deadline

    def end_call(self) -> None:
        self.deadline = None
        if self._waits_capped and not self.broken:
            self._set_waits(self.timeout_s)
        self._waits_capped = False

    def _set_waits(self, seconds: float) -> None:
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
        except OSError as exc:
            raise self._fail(exc, "setting socket timeouts") from exc

    def _cap_wait(self, doing: str) -> float:
        """Before a blocking wait: raises TimeoutError when the call's deadline has passed, and
        lowers the socket timeouts to what is left of it once that is under timeout_s."""
        if self.deadline is None:
            return self.timeout_s
        left = self.deadline.left()
        if left <= 0:
            self.broken = True  # a request may be in flight: the stream is not reusable
            self.deadline.check(self.address, doing)
        if left < self.timeout_s:
            self._set_waits(max(left, 0.001))
            self._waits_capped = True
            return left
        return self.timeout_s

    # -- errors -------------------------------------------------------------

    def _fail(self, exc: BaseException, doing: str):
        self.broken = True
        if isinstance(exc, BlockingIOError) and self._waits_capped and self.deadline is not None:
            return errors.TimeoutError(
                f"gcache-server at {self.address} made no progress {doing} until the call ran out "
                f"of its {self.deadline.budget_s:g}s (call_timeout_s); it may be overloaded or hung",
                self.address,
            )
        if isinstance(exc, BlockingIOError):
            return errors.TimeoutError(
                f"gcache-server at {self.address} made no progress {doing} for {self.timeout_s}s; "
                "it may be overloaded or hung: check it, or raise timeout_s",
                self.address,
            )
        return errors.ConnectionError(
            f"connection to gcache-server at {self.address} failed while {doing}: {exc}; "
            "the server may have restarted or stopped",
            self.address,
        )

    def _closed_by_peer(self, doing: str):
        self.broken = True
        return errors.ConnectionError(
            f"gcache-server at {self.address} closed the connection while {doing}; "
            "it may have restarted, shut down, or dropped an idle connection",
            self.address,
        )

    # -- sending ------------------------------------------------------------

    def send(self, parts: list) -> None:
        """Sends byte buffers back to back with sendmsg (gather write, no joining);
        a last part that is HashedValues goes through the native hashing sender."""
        if parts and isinstance(parts[-1], HashedValues):
            self._send_hashed(parts[:-1], parts[-1])
            return
        self._cap_wait("sending a request")
        if len(parts) == 1:  # a request with no payload: one send, whole in the common case
            try:
                sent = self.sock.send(parts[0])
            except OSError as exc:
                raise self._fail(exc, "sending a request") from exc
            if sent == len(parts[0]):
                return
            parts = [memoryview(parts[0])[sent:]]
        pending = [p for p in parts if len(p)]
        i = 0
        try:
            while i < len(pending):
                sent = self.sock.sendmsg(pending[i : i + IOV_PER_SENDMSG_MAX])
                while sent:
                    size = len(pending[i])
                    if sent >= size:
                        sent -= size
                        i += 1
                    else:
                        pending[i] = memoryview(pending[i])[sent:]
                        sent = 0
        except OSError as exc:
            raise self._fail(exc, "sending a request") from exc

    def _send_hashed(self, head_parts: list, hashed: HashedValues) -> None:
        head = head_parts[0] if len(head_parts) == 1 else b"".join(head_parts)
        size = len(head) + len(hashed)
        timeout_ms = int((self.timeout_s + size / BULK_READ_BYTES_PER_S_MIN) * 1000)
        try:
            _native_send_put_hashed(self.sock.fileno(), head, hashed.values, hashed.kind, timeout_ms)
        except OSError as exc:  # TimeoutError and ConnectionError are OSErrors too
            raise self._fail(exc, "sending a request") from exc

    # -- receiving ----------------------------------------------------------

    def _recv_some(self, view) -> int:
        self._cap_wait("waiting for a response")
        try:
            n = self.sock.recv_into(view)
        except OSError as exc:
            raise self._fail(exc, "waiting for a response") from exc
        if n == 0:
            raise self._closed_by_peer("a response was expected")
        return n

    def _fill(self, needed: int) -> None:
        """Ensures `needed` (<= buffer size) bytes are buffered."""
        if self._end - self._pos >= needed:
            return
        if self._pos + needed > READ_BUFFER_BYTES:
            tail = self._rbuf[self._pos : self._end]
            self._rbuf[: len(tail)] = tail
            self._end = len(tail)
            self._pos = 0
        while self._end - self._pos < needed:
            self._end += self._recv_some(self._rview[self._end :])

    def read_header(self) -> tuple[int, int, int, int, int, int]:
        """Returns (opcode, flags, request_id, meta_len, status, payload_len)."""
        self._fill(HEADER_BYTES)
        magic, version, opcode, flags, request_id, meta_len, status, payload_len = HEADER.unpack_from(
            self._rbuf, self._pos
        )
        self._pos += HEADER_BYTES
        if magic != MAGIC or version != VERSION:
            self.broken = True
            raise errors.ProtocolError(
                f"gcache-server at {self.address} sent a frame with magic {magic!r} version "
                f"{version} (expected {MAGIC!r} v{VERSION}): is that port a GCache v1 server?"
            )
        if meta_len > META_BYTES_MAX:
            self.broken = True
            raise errors.ProtocolError(
                f"gcache-server at {self.address} sent {meta_len} B of metadata, over the {META_BYTES_MAX} B limit"
            )
        return opcode, flags, request_id, meta_len, status, payload_len

    def read_meta(self, meta_len: int) -> dict:
        try:
            if meta_len <= READ_BUFFER_BYTES:
                self._fill(meta_len)
                start = self._pos
                self._pos += meta_len
                return decode_meta(self._rview[start : start + meta_len])
            big = bytearray(meta_len)
            self.read_into(memoryview(big))
            return decode_meta(big)
        except errors.ProtocolError:
            self.broken = True
            raise

    def read_into(self, target: memoryview) -> None:
        """Fills `target` (a byte memoryview) completely from the stream."""
        size = len(target)
        got = min(self._end - self._pos, size)
        if got:
            target[:got] = self._rview[self._pos : self._pos + got]
            self._pos += got
        while got < size:
            left = size - got
            if left >= DIRECT_READ_BYTES_MIN:
                got += self._recv_some(target[got:])
            else:
                self._fill(left)
                target[got:] = self._rview[self._pos : self._pos + left]
                self._pos += left
                got = size

    def read_into_many(self, targets: list[memoryview]) -> None:
        """Fills every target in order: buffered bytes first, then one scatter read."""
        rest = []
        k = 0
        while k < len(targets) and self._end > self._pos:  # the buffered bytes first
            target = targets[k]
            got = min(self._end - self._pos, len(target))
            target[:got] = self._rview[self._pos : self._pos + got]
            self._pos += got
            if got < len(target):
                rest.append(target[got:])
            k += 1
        rest += targets[k:] if k else targets  # the rest, read by one scatter read
        total = sum(map(len, rest))
        if total < DIRECT_READ_BYTES_MIN:
            for target in rest:
                self.read_into(target)
            return
        timeout_s = self.timeout_s + total / BULK_READ_BYTES_PER_S_MIN
        if self.deadline is not None:
            self._cap_wait("receiving values")
            timeout_s = max(0.001, self.deadline.cap(timeout_s))
        timeout_ms = max(1, int(timeout_s * 1000))
        try:
            _native_recv_into_buffers(self.sock.fileno(), rest, timeout_ms)
        except builtins.TimeoutError as exc:
            self.broken = True
            raise errors.TimeoutError(
                f"gcache-server at {self.address} did not deliver {total} bytes within "
                f"{timeout_ms} ms; it may be overloaded or hung: check it, or raise timeout_s",
                self.address,
            ) from exc
        except OSError as exc:
            raise self._fail(exc, "receiving values") from exc

    def receive_with_fd(self) -> int | None:
        """Reads what has arrived (at least one byte) into the read buffer, taking the
        file descriptor passed alongside it (SCM_RIGHTS), if any. Only on an empty
        buffer: a descriptor travels with the first byte of its response."""
        if self._pos != self._end:
            raise errors.ProtocolError("receive_with_fd needs an empty read buffer")
        self._cap_wait("waiting for a response")
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, READ_BUFFER_BYTES, 1)
        except OSError as exc:
            raise self._fail(exc, "waiting for a response") from exc
        if not data:
            for fd in fds:
                os.close(fd)
            raise self._closed_by_peer("a response was expected")
        self._rbuf[: len(data)] = data
        self._pos, self._end = 0, len(data)
        return fds[0] if fds else None

    def buffered_bytes(self) -> int:
        return self._end - self._pos

    def read_bytes(self, size: int) -> bytes:
        if size <= self._end - self._pos:
            start = self._pos
            self._pos += size
            return bytes(self._rview[start : start + size])
        out = bytearray(size)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, size: int) -> None:
        """Reads and drops `size` bytes (a value that did not fit the caller's buffer)."""
        while size:
            if self._pos == self._end:
                self._pos = self._end = 0
                self._end = self._recv_some(self._rview)
            step = min(size, self._end - self._pos)
            self._pos += step
            size -= step
