"""GCache wire protocol v1 (docs/protocol.md): header, opcodes, statuses, metadata.

Shared by the client, the bench and tests. A frame is a 32-byte header, then
`meta_len` bytes of msgpack (always a map), then `payload_len` raw bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from enum import IntEnum
from typing import Any, NamedTuple, cast

import msgpack

from gcache.errors import KeyInvalidError, ProtocolError

HEADER = struct.Struct("<4sBBHQIIQ")
HEADER_BYTES = HEADER.size  # 32
MAGIC = b"GCH1"
VERSION = 1
FLAG_RESPONSE = 1
FLAG_NO_REPLY = 2  # on a RELEASE request: the server sends no answer

KEY_BYTES_MAX = 512
META_BYTES_MAX = 16 * 1024 * 1024
BATCH_KEYS_MAX = 16384  # server default --batch-keys-max
FRAME_PAYLOAD_BYTES_MAX = 2 * 1024 * 1024 * 1024  # server default
HISTOGRAM_BUCKETS = 32

if HEADER_BYTES != 32:  # the wire format fixes it (docs/protocol.md)
    raise ImportError(f"frame header is {HEADER_BYTES} bytes; the protocol says 32")


class Opcode(IntEnum):
    PING = 1
    STATS = 2
    PUT_BATCH = 3
    GET_BATCH = 4
    EXISTS_BATCH = 5
    REMOVE_BATCH = 6
    AUTH = 7  # challenge-response handshake (docs/protocol.md, "Authentication")
    # One-sided access (docs/protocol.md, "Shared memory and RDMA").
    SHM_ATTACH = 8  # the arena's memfd over the Unix socket (SCM_RIGHTS)
    LOOKUP = 9  # per key: offset, length, checksum, under one lease
    RELEASE = 10  # drops leases and reservations
    RESERVE = 11  # arena blocks to write new values into
    COMMIT = 12  # publishes reserved blocks (checksums verified)
    RDMA_CONNECT = 13  # queue-pair setup for transport "rdma" (server with --rdma-device)


class FrameStatus(IntEnum):
    OK = 0
    BAD_FRAME = 1
    UNKNOWN_OPCODE = 2
    LIMIT_EXCEEDED = 3
    BAD_VERSION = 4
    BUSY = 5
    SHUTTING_DOWN = 6
    INTERNAL = 7
    STALE_EPOCH = 8  # the request's cluster-map epoch is older than the node's; nothing was done
    UNAUTHENTICATED = 9  # no valid AUTH on a node with --auth-file; the connection is closed
    FORBIDDEN = 10  # the tenant's roles do not allow the request; the connection stays open


class PutStatus(IntEnum):
    STORED = 0
    EXISTS = 1
    NO_SPACE = 2
    CHECKSUM_MISMATCH = 3
    VALUE_TOO_LARGE = 4
    KEY_INVALID = 5


class ChecksumKind(IntEnum):
    """Which algorithm a value's checksum is ("ck" / "cks" on the wire; per value in
    the node and on disk). The numbers are the contract: never renumber."""

    XXH64 = 0  # XXH64 seed 0: peers from before XXH3 ("ck" absent means this)
    XXH3 = 1  # XXH3-64, no seed: every new value


def checksum_kinds_of(meta: dict[str, Any]) -> list[int]:
    """The checksum kinds a node speaks, from its PING or SHM_ATTACH answer ("cks");
    a node from before XXH3 sends none and speaks xxh64 only."""
    kinds = meta.get("cks")
    if not isinstance(kinds, list):
        return [ChecksumKind.XXH64]
    return [k for k in kinds if isinstance(k, int)]


class RemoveStatus(IntEnum):
    REMOVED = 0
    NOT_FOUND = 1


class Header(NamedTuple):
    opcode: int
    flags: int
    request_id: int
    meta_len: int
    status: int
    payload_len: int

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)


def encode_header(
    opcode: int, request_id: int, meta_len: int, payload_len: int, status: int = 0, flags: int = 0
) -> bytes:
    return HEADER.pack(MAGIC, VERSION, opcode, flags, request_id, meta_len, status, payload_len)


def decode_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parses the first 32 bytes of `buf`; ProtocolError if the framing is wrong."""
    if len(buf) < HEADER_BYTES:
        raise ProtocolError(f"frame header needs {HEADER_BYTES} bytes, got {len(buf)}")
    magic, version, opcode, flags, request_id, meta_len, status, payload_len = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): the peer is not a "
            "GCache v1 server, or the stream lost its framing"
        )
    if version != VERSION:
        raise ProtocolError(
            f"peer speaks protocol version {version}, this client speaks {VERSION}: upgrade the older side"
        )
    if meta_len > META_BYTES_MAX:
        raise ProtocolError(f"frame metadata of {meta_len} bytes exceeds the {META_BYTES_MAX} B limit")
    return Header(opcode, flags, request_id, meta_len, status, payload_len)


def encode_meta(meta: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(meta, use_bin_type=True)
    return out


def decode_meta(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """msgpack map -> dict; ProtocolError if it is not a map."""
    try:
        meta = msgpack.unpackb(buf, raw=False, strict_map_key=False, unicode_errors="replace")
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame metadata is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict):
        raise ProtocolError(f"frame metadata must be a msgpack map, got {type(meta).__name__}")
    return meta


_KEYS_MAP_ONE = b"\x81\xa4keys\x91"  # msgpack: {"keys": [ <one element> ]}
_KEYS_EPOCH_MAP_ONE = b"\x82\xa4keys\x91"  # msgpack: {"keys": [ <one element> ], "epoch": ...}
_EPOCH_FIELD = b"\xa5epoch"
_CK_XXH3_FIELD = b"\xa2ck\x01"  # "ck": 1 (ChecksumKind.XXH3)


def encode_keys_meta(keys: list[bytes], epoch: int | None = None, ck: bool = False) -> bytes:
    """msgpack of {"keys": keys} (keys as bin), plus "epoch" when given, plus
    "ck": 1 with `ck` (a read that understands "cks"); the one-key case skips
    msgpack's overhead."""
    if len(keys) == 1:
        key = keys[0]
        size = len(key)
        length = bytes((0xC4, size)) if size < 256 else b"\xc5" + size.to_bytes(2, "big")
        head = _KEYS_MAP_ONE if epoch is None else _KEYS_EPOCH_MAP_ONE
        if ck:
            head = bytes((head[0] + 1,)) + head[1:]  # one more map entry
        out = head + length + key
        if epoch is not None:
            out += _EPOCH_FIELD + msgpack.packb(epoch)
        return out + _CK_XXH3_FIELD if ck else out
    meta: dict[str, Any] = {"keys": keys}
    if epoch is not None:
        meta["epoch"] = epoch
    if ck:
        meta["ck"] = int(ChecksumKind.XXH3)
    packed: bytes = msgpack.packb(meta, use_bin_type=True)
    return packed


def encode_frame_head(
    opcode: int, request_id: int, meta: dict[str, Any], payload_len: int = 0, status: int = 0, flags: int = 0
) -> bytes:
    """Header + metadata as one bytes object; the payload is sent after it, uncopied."""
    meta_bytes = encode_meta(meta)
    return encode_header(opcode, request_id, len(meta_bytes), payload_len, status, flags) + meta_bytes


def normalize_key(key: object) -> bytes:
    """bytes/str/bytearray/memoryview -> bytes of 1..512; KeyInvalidError otherwise."""
    if isinstance(key, bytes):
        raw = key
    elif isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, (bytearray, memoryview)):
        raw = bytes(key)
    else:
        raise KeyInvalidError(f"a key must be bytes or str, got {type(key).__name__}")
    if not raw:
        raise KeyInvalidError("a key must not be empty")
    if len(raw) > KEY_BYTES_MAX:
        raise KeyInvalidError(
            f"key of {len(raw)} bytes is longer than {KEY_BYTES_MAX}: hash long names "
            f"(gcache.wire.keys builds short content-addressed keys); key starts {raw[:32]!r}"
        )
    return raw


def normalize_keys(keys: Iterable[object]) -> list[bytes]:
    if isinstance(keys, (bytes, str)):
        raise KeyInvalidError("expected a list of keys, got a single key: wrap it in a list")
    # normalize_key inlined for the common keys (str and bytes of a valid length): a batch's
    # keys cost no function call each; anything else goes through normalize_key (and its errors).
    out: list[bytes] = []
    append = out.append
    for key in keys:
        cls = type(key)
        # exact types (a subclass goes through normalize_key); mypy cannot narrow on type(key)
        raw: bytes = cast(bytes, key) if cls is bytes else cast(str, key).encode("utf-8") if cls is str else b""
        if not 0 < len(raw) <= KEY_BYTES_MAX:
            raw = normalize_key(key)
        append(raw)
    return out
