"""A raw docs/protocol.md client for tests: struct + msgpack over a socket.

Deliberately independent of gcache.client, so server tests check the wire
contract itself.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import msgpack

from gcache._native import xxh64
from gcache.wire.auth import auth_mac, token_id
from gcache.wire.protocol import HEADER, MAGIC, FrameStatus, Opcode, PutStatus

# The protocol's numbers come from their one home, gcache.wire.protocol, under their bare names.
(
    PING,
    STATS,
    PUT_BATCH,
    GET_BATCH,
    EXISTS_BATCH,
    REMOVE_BATCH,
    AUTH,
    SHM_ATTACH,
    LOOKUP,
    RELEASE,
    RESERVE,
    COMMIT,
    RDMA_CONNECT,
) = (
    Opcode.PING,
    Opcode.STATS,
    Opcode.PUT_BATCH,
    Opcode.GET_BATCH,
    Opcode.EXISTS_BATCH,
    Opcode.REMOVE_BATCH,
    Opcode.AUTH,
    Opcode.SHM_ATTACH,
    Opcode.LOOKUP,
    Opcode.RELEASE,
    Opcode.RESERVE,
    Opcode.COMMIT,
    Opcode.RDMA_CONNECT,
)
(
    OK,
    BAD_FRAME,
    UNKNOWN_OPCODE,
    LIMIT_EXCEEDED,
    BAD_VERSION,
    BUSY,
    SHUTTING_DOWN,
    INTERNAL,
    STALE_EPOCH,
    UNAUTHENTICATED,
    FORBIDDEN,
) = (
    FrameStatus.OK,
    FrameStatus.BAD_FRAME,
    FrameStatus.UNKNOWN_OPCODE,
    FrameStatus.LIMIT_EXCEEDED,
    FrameStatus.BAD_VERSION,
    FrameStatus.BUSY,
    FrameStatus.SHUTTING_DOWN,
    FrameStatus.INTERNAL,
    FrameStatus.STALE_EPOCH,
    FrameStatus.UNAUTHENTICATED,
    FrameStatus.FORBIDDEN,
)
(STORED, EXISTS, NO_SPACE, CHECKSUM_MISMATCH, VALUE_TOO_LARGE, KEY_INVALID) = (
    PutStatus.STORED,
    PutStatus.EXISTS,
    PutStatus.NO_SPACE,
    PutStatus.CHECKSUM_MISMATCH,
    PutStatus.VALUE_TOO_LARGE,
    PutStatus.KEY_INVALID,
)


@dataclass
class Frame:
    opcode: int
    flags: int
    request_id: int
    status: int
    meta: dict
    payload: bytes


def frame_bytes(
    opcode: int,
    meta,
    payload: bytes = b"",
    request_id: int = 1,
    *,
    magic: bytes = MAGIC,
    version: int = 1,
    meta_len: int | None = None,
    payload_len: int | None = None,
    flags: int = 0,
) -> bytes:
    """One request frame; meta may be a dict (packed) or raw bytes. Lengths can be forged."""
    meta_bytes = meta if isinstance(meta, (bytes, bytearray)) else msgpack.packb(meta, use_bin_type=True)
    header = HEADER.pack(
        magic,
        version,
        opcode,
        flags,
        request_id,
        len(meta_bytes) if meta_len is None else meta_len,
        0,
        len(payload) if payload_len is None else payload_len,
    )
    return header + bytes(meta_bytes) + bytes(payload)


def put_frame(items, request_id: int = 1, sums=None) -> bytes:
    keys = [k for k, _ in items]
    values = [v for _, v in items]
    meta = {
        "keys": keys,
        "lens": [len(v) for v in values],
        "sums": sums if sums is not None else [xxh64(v) for v in values],
    }
    return frame_bytes(Opcode.PUT_BATCH, meta, b"".join(values), request_id)


class RawConnection:
    def __init__(self, port: int, timeout_s: float = 20.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next_id = 1

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            r = self.sock.recv_into(view[got:])
            if r == 0:
                raise ConnectionError(f"server closed the connection after {got} of {n} bytes")
            got += r
        return bytes(buf)

    def recv_frame(self) -> Frame:
        magic, version, opcode, flags, rid, meta_len, status, payload_len = HEADER.unpack(self.recv_exact(32))
        assert magic == MAGIC and version == 1, (magic, version)
        assert flags & 1, "responses carry the response flag"
        meta = msgpack.unpackb(self.recv_exact(meta_len), raw=False) if meta_len else {}
        payload = self.recv_exact(payload_len) if payload_len else b""
        return Frame(opcode, flags, rid, status, meta, payload)

    def closed_by_server(self) -> bool:
        """True once the server has closed (EOF or reset); reads and drops anything before it."""
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except ConnectionResetError:
            return True

    def request(self, opcode: int, meta, payload: bytes = b"") -> Frame:
        rid = self._next_id
        self._next_id += 1
        self.send(frame_bytes(opcode, meta, payload, rid))
        frame = self.recv_frame()
        assert frame.request_id == rid and frame.opcode == opcode
        return frame

    def put(self, items, sums=None) -> list[int]:
        rid = self._next_id
        self._next_id += 1
        self.send(put_frame(items, rid, sums))
        frame = self.recv_frame()
        assert frame.request_id == rid and frame.status == OK, frame
        return frame.meta["st"]

    def get(self, keys) -> list[bytes | None]:
        frame = self.request(GET_BATCH, {"keys": keys})
        assert frame.status == OK, frame
        out, offset = [], 0
        for length, checksum in zip(frame.meta["lens"], frame.meta["sums"]):
            if length < 0:
                assert checksum == 0
                out.append(None)
                continue
            value = frame.payload[offset : offset + length]
            assert xxh64(value) == checksum, "a GET must return bytes that match their checksum"
            out.append(value)
            offset += length
        assert offset == len(frame.payload)
        return out

    def exists(self, keys) -> tuple[list[bool], int]:
        frame = self.request(EXISTS_BATCH, {"keys": keys})
        assert frame.status == OK, frame
        return frame.meta["ex"], frame.meta["prefix"]

    def remove(self, keys) -> list[int]:
        frame = self.request(REMOVE_BATCH, {"keys": keys})
        assert frame.status == OK, frame
        return frame.meta["st"]

    def stats(self) -> dict:
        frame = self.request(STATS, {})
        assert frame.status == OK, frame
        return frame.meta

    def ping(self) -> dict:
        frame = self.request(PING, {})
        assert frame.status == OK, frame
        return frame.meta


def raw_auth(conn: RawConnection, token: str) -> RawConnection:
    challenge = conn.request(AUTH, {})
    assert challenge.status == 0 and challenge.meta["auth"] is True
    nonce = challenge.meta["nonce"]
    assert len(nonce) == 32
    answer = conn.request(AUTH, {"id": token_id(token), "mac": auth_mac(token, nonce)})
    assert answer.status == 0, answer.meta
    return conn
