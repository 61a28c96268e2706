"""Request frames of one batch slice, and how each reads its response.

An operation covers keys [lo, hi) of a caller's batch and writes its answers
into the shared `BatchResult`, so a batch split into several frames (and any
retry of them) fills one result list. Per-key problems (value too large,
buffer too small, bad checksum) are collected and raised once the whole batch
has been read, so the connection stays in sync and other keys still count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from gcache import errors
from gcache._native import checksum, xxh64
from gcache.client.connection import HashedValues
from gcache.wire.protocol import (
    HEADER_BYTES,
    ChecksumKind,
    FrameStatus,
    Opcode,
    PutStatus,
    RemoveStatus,
    encode_header,
    encode_keys_meta,
    encode_meta,
)
from gcache.wire.worth import Worth, worth_field

# Bytes per key a response map may use, for bounding what is in flight (msgpack
# uint64 is 9 bytes at most; a bool 1).
_RESPONSE_BYTES_PER_KEY = 9
_RESPONSE_BYTES_FIXED = HEADER_BYTES + 64
RESPONSE_BYTES_UNBOUNDED = 1 << 62  # an int, so in-flight sums stay exact


class BatchResult:
    """Answers for a whole batch plus the per-key problems found while reading."""

    def __init__(self, keys: list[bytes]):
        self.keys = keys
        self.values: list = [None] * len(keys)
        self.prefixes: dict[int, int] = {}  # lo -> leading existing keys in that slice
        self.meta: dict | None = None
        self.worth: Sequence[Worth] | None = None  # a put's per-key "worth" (gcache.wire.worth)
        self.reset()

    def reset(self) -> None:
        self.too_large: list[int] = []
        self.too_small: list[tuple[int, int]] = []  # (index, value size)
        self.bad_checksum: list[int] = []

    def raise_problems(self, address: str) -> None:
        if self.too_large:
            keys = [self.keys[i] for i in self.too_large]
            large = errors.ValueTooLargeError(
                f"gcache-server at {address} refused {len(keys)} value(s) as larger than its "
                f"--value-bytes-max (first key {keys[0]!r}): split the value or raise the limit",
                keys,
            )
            large.results = self.values
            raise large
        if self.too_small:
            keys = [self.keys[i] for i, _ in self.too_small]
            sizes = [size for _, size in self.too_small]
            small = errors.BufferTooSmallError(
                f"{len(keys)} value(s) did not fit their buffers (key {keys[0]!r} needs "
                f"{sizes[0]} bytes); those buffers were left untouched: pass larger buffers",
                keys,
                sizes,
            )
            small.results = self.values
            raise small
        if self.bad_checksum:
            keys = [self.keys[i] for i in self.bad_checksum]
            bad = errors.ChecksumMismatchError(
                f"{len(keys)} value(s) failed their checksum check (first key {keys[0]!r}): the "
                "bytes were corrupted or the buffer changed while being sent; retry the call",
                keys,
            )
            bad.results = self.values
            raise bad


def encode_request_meta(meta: dict, epoch: int | None) -> bytes:
    """A request map, with the client's cluster-map epoch when it has one."""
    if epoch is not None:
        meta["epoch"] = epoch
    return encode_meta(meta)


def record_put_status(result: BatchResult, i: int, st: int) -> None:
    """Key i's answer from a final per-key put status (PUT_BATCH, RESERVE, COMMIT)."""
    out = result.values
    if st == PutStatus.STORED or st == PutStatus.EXISTS:
        out[i] = True
    elif st == PutStatus.NO_SPACE:
        out[i] = False
    elif st == PutStatus.VALUE_TOO_LARGE:
        out[i] = False
        result.too_large.append(i)
    elif st == PutStatus.CHECKSUM_MISMATCH:
        out[i] = False
        result.bad_checksum.append(i)
    elif st == PutStatus.KEY_INVALID:
        raise errors.KeyInvalidError(f"gcache-server rejected key {result.keys[i]!r}")
    else:
        raise errors.ProtocolError(f"unknown put status {st!r} for key {result.keys[i]!r}")


_STORED_OR_EXISTS = frozenset((PutStatus.STORED, PutStatus.EXISTS))


def record_put_statuses(result: BatchResult, lo: int, statuses: list) -> None:
    """record_put_status for keys lo, lo + 1, ...: one slice assignment when every key
    was stored (or existed), the common case, instead of a call per key."""
    try:
        every_key_ok = _STORED_OR_EXISTS.issuperset(statuses)
    except TypeError:  # an unhashable status: record_put_status names it
        every_key_ok = False
    if every_key_ok:
        result.values[lo : lo + len(statuses)] = [True] * len(statuses)
        return
    for i, st in enumerate(statuses, lo):
        record_put_status(result, i, st)


def _expect_list(meta: dict, field: str, n: int) -> list:
    value = meta.get(field)
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise errors.ProtocolError(f"response field {field!r} should list {n} entries, got {got}")
    return value


class Operation(ABC):
    """One request frame over keys [lo, hi) of a batch, and how its answer is read.

    The contract the pipeline (gcache.client.pipeline) runs every operation by: it calls
    response_bytes_max() to bound what is in flight, frame() to send, on_response() once the
    answer's header and map are read, then follow_ups() (more frames on the same connection)
    or, for a frame the server refused as over its limits, split(). Answers go into
    `result` (shared by every operation of the batch, and by retries of them); per-key
    problems are recorded there, never raised. Subclasses set `opcode` and implement
    on_response; the rest has defaults for a request map of `keys` and no payload.
    """

    opcode: Opcode

    def __init__(self, result: BatchResult, lo: int = 0, hi: int = 0):
        self.result = result
        self.lo = lo
        self.hi = hi

    @property
    def keys(self) -> list[bytes]:
        """The keys this operation covers: result.keys[lo:hi]."""
        return self.result.keys[self.lo : self.hi]

    def request_meta_bytes(self, epoch: int | None) -> bytes:
        """The encoded request map (called once per send, so a retry re-encodes it);
        `epoch`, when not None, goes in it. Default: {"keys": keys}."""
        return encode_keys_meta(self.keys, epoch)

    def payload(self) -> list:
        """Buffers sent after the request map, in order (not copied). Default: none."""
        return []

    def payload_bytes(self) -> int:
        """Total bytes of payload(). Default: 0."""
        return 0

    def response_bytes_max(self) -> int:
        """An upper bound on the answer's size (RESPONSE_BYTES_UNBOUNDED when values come
        back), used to bound the bytes in flight on a connection."""
        return _RESPONSE_BYTES_FIXED + _RESPONSE_BYTES_PER_KEY * (self.hi - self.lo)

    def frame(self, request_id: int, epoch: int | None = None) -> tuple[list, int]:
        """(buffers to send, request bytes) for this operation; `epoch`, when not
        None, goes into the request map (the node refuses it if its map is newer)."""
        meta = self.request_meta_bytes(epoch)
        payload = self.payload()
        payload_len = self.payload_bytes()
        head = encode_header(self.opcode, request_id, len(meta), payload_len) + meta
        return [head, *payload], len(head) + payload_len

    @abstractmethod
    def on_response(self, conn, meta: dict, payload_len: int) -> None:
        """Read an OK answer: `meta` is its decoded map, and exactly payload_len payload
        bytes follow on `conn`, which this must consume (read or skip) to keep the
        connection in sync. Writes answers for keys lo..hi-1 into result; raises
        ProtocolError for an answer that breaks the protocol (the connection is dropped)."""

    def explain_error(self, exc: Exception, status: int, meta: dict) -> Exception:
        """The exception to raise for a refused frame (default: `exc` as it is)."""
        return exc

    def follow_ups(self) -> list[Operation] | None:
        """Operations to send next on the same connection, once this one's answer was
        read (a RESERVE's COMMIT); None when there are none."""
        return None

    def split(self) -> list[Operation] | None:
        """Two operations covering this one's keys, for a frame the server refused as
        over its limits while keeping the connection open; None if it cannot split."""
        return None


# Values at least this large (on average over a frame) carry their sums after them
# ("trail"), hashed while sent; smaller ones carry them in the map: hashing a small
# value first costs nothing (it stays in cache), and a trailing sum per tiny value
# would cost the node a receive each.
TRAIL_VALUE_BYTES_MIN = 16 << 10
_OLD_NODE_HINT = (
    "it is a node from before XXH3 checksums and does not speak them; nothing was stored. "
    "Upgrade the node, or set GCACHE_CHECKSUM=xxh64 in this client to write with the old checksum"
)


class PutOp(Operation):
    """PUT_BATCH. With XXH3 (every node since XXH3) large values' sums trail them in
    the payload ("trail"): the client hashes each group of values just before it
    sends it, the node hashes each piece as it lands; small values' XXH3 sums go in
    the map with "ck". With XXH64 (a node from before XXH3, or GCACHE_CHECKSUM=xxh64)
    the sums go in the map, as before."""

    opcode = Opcode.PUT_BATCH

    def __init__(self, result: BatchResult, lo: int, hi: int, values: list[memoryview], kind: int = ChecksumKind.XXH3):
        super().__init__(result, lo, hi)
        self.values = values  # views for keys lo..hi-1
        self.kind = kind
        size = sum(len(v) for v in values)
        self.trail = kind != ChecksumKind.XXH64 and bool(values) and size >= TRAIL_VALUE_BYTES_MIN * len(values)
        self.size = size

    def request_meta_bytes(self, epoch: int | None) -> bytes:
        meta = {"keys": self.keys, "lens": [len(v) for v in self.values]}
        if self.kind != ChecksumKind.XXH64:
            meta["ck"] = int(self.kind)
        if self.result.worth is not None:
            meta["worth"] = worth_field(self.result.worth[self.lo : self.hi])
        if self.trail:
            meta["trail"] = True
        else:
            # Hashed when the frame is sent, so hashing frame k+1 (GIL released)
            # overlaps the server storing frame k.
            kind = int(self.kind)
            meta["sums"] = [xxh64(v) for v in self.values] if kind == 0 else [checksum(v, kind) for v in self.values]
        return encode_request_meta(meta, epoch)

    def payload(self) -> list:
        return [HashedValues(self.values, int(self.kind))] if self.trail else self.values

    def payload_bytes(self) -> int:
        return self.size + 8 * len(self.values) if self.trail else self.size

    def explain_error(self, exc, status, meta):
        message = meta.get("error") if isinstance(meta, dict) else None
        if (
            self.trail
            and status == FrameStatus.BAD_FRAME
            and isinstance(message, str)
            and '"sums"' in message
            and "trail" not in message
        ):
            return errors.ProtocolError(f"the gcache-server refused this PUT ({message}): {_OLD_NODE_HINT}")
        return exc

    def on_response(self, conn, meta, payload_len):
        statuses = _expect_list(meta, "st", self.hi - self.lo)
        conn.skip(payload_len)
        if (
            self.kind != ChecksumKind.XXH64
            and statuses
            and all(st == PutStatus.CHECKSUM_MISMATCH for st in statuses)
            and "ck" not in meta  # a node that speaks XXH3 names the kind it checked
        ):
            # Every XXH3 sum refused: a node from before XXH3 checked them as xxh64.
            raise errors.ProtocolError(f"every value of this PUT failed its checksum: {_OLD_NODE_HINT}")
        record_put_statuses(self.result, self.lo, statuses)


class _ValuesOp(Operation):
    """GET_BATCH: the response lists value lengths (-1 = miss), then the values."""

    opcode = Opcode.GET_BATCH

    def __init__(self, result, lo, hi, verify_checksums: bool):
        super().__init__(result, lo, hi)
        self.verify = verify_checksums
        self.kinds: list | None = None  # per value ("cks"); None: all xxh64 (a node from before XXH3)

    def request_meta_bytes(self, epoch: int | None) -> bytes:
        return encode_keys_meta(self.keys, epoch, ck=True)  # this client reads "cks"

    def response_bytes_max(self) -> int:
        return RESPONSE_BYTES_UNBOUNDED

    def checksum_of(self, j: int, value) -> int:
        """The checksum of value j of this answer, by the kind the node named."""
        kind = self.kinds[j] if self.kinds is not None else ChecksumKind.XXH64
        return checksum(value, kind)

    def on_response(self, conn, meta, payload_len):
        n = self.hi - self.lo
        lens = _expect_list(meta, "lens", n)
        sums = _expect_list(meta, "sums", n) if self.verify else None
        self.kinds = _expect_list(meta, "cks", n) if self.verify and "cks" in meta else None
        if sum(size for size in lens if size > 0) != payload_len:
            raise errors.ProtocolError(
                f"GET response payload is {payload_len} bytes but its lengths add up to "
                f"{sum(size for size in lens if size > 0)}"
            )
        self.read_values(conn, lens, sums, payload_len)

    @abstractmethod
    def read_values(self, conn, lens: list, sums: list | None, payload_len: int) -> None:
        """Read the values (lens[j] bytes for key lo + j, -1 a miss; payload_len in all)
        from conn into result.values; with sums (verify_checksums), a value whose xxh64
        differs becomes a miss recorded in result.bad_checksum."""

    def split(self):
        # LIMIT_EXCEEDED on a GET (found values over the server's frame payload
        # limit, or more keys than its batch_keys_max) leaves the connection open:
        # halves are retried on it. One key cannot be split; it cannot hit the
        # payload limit either, since the server keeps value_bytes_max <= it.
        if self.hi - self.lo < 2:
            return None
        mid = (self.lo + self.hi) // 2
        return [self.part(self.lo, mid), self.part(mid, self.hi)]

    @abstractmethod
    def part(self, lo: int, hi: int) -> _ValuesOp:
        """The same operation over keys [lo, hi), a sub-range of this one's (for split)."""


class GetOp(_ValuesOp):
    """Values come back as new bytes objects."""

    def part(self, lo, hi):
        return GetOp(self.result, lo, hi, self.verify)

    def read_values(self, conn, lens, sums, payload_len):
        out = self.result.values
        if payload_len <= conn.buffered_bytes():  # small values: already read, one copy each
            for j, size in enumerate(lens):
                out[self.lo + j] = conn.read_bytes(size) if size >= 0 else None
        else:
            arrays = [bytearray(size) if size >= 0 else None for size in lens]
            conn.read_into_many([memoryview(a) for a in arrays if a is not None])
            for j, array in enumerate(arrays):
                out[self.lo + j] = bytes(array) if array is not None else None
        if sums is not None:
            for j, size in enumerate(lens):
                value = out[self.lo + j]
                if value is not None and self.checksum_of(j, value) != sums[j]:
                    self.result.bad_checksum.append(self.lo + j)
                    out[self.lo + j] = None


class GetIntoOp(_ValuesOp):
    """Values land directly in the caller's buffers (one per key)."""

    def __init__(self, result, lo, hi, verify_checksums, targets: list[memoryview]):
        super().__init__(result, lo, hi, verify_checksums)
        self.targets = targets

    def part(self, lo, hi):
        return GetIntoOp(self.result, lo, hi, self.verify, self.targets[lo - self.lo : hi - self.lo])

    def read_values(self, conn, lens, sums, payload_len):
        out = self.result.values
        lo, targets = self.lo, self.targets
        dests: list[memoryview | None] = []
        append = dests.append
        all_fit = True
        for j, size in enumerate(lens):
            if size < 0:
                out[lo + j] = None
                continue
            target = targets[j]
            room = len(target)
            if size > room:
                out[lo + j] = None
                self.result.too_small.append((lo + j, size))
                append(None)
                all_fit = False
            else:
                out[lo + j] = size
                append(target if size == room else target[:size])
        if all_fit:
            conn.read_into_many(dests)
        else:  # never write past a caller's buffer: drop the values that do not fit
            for dest, size in zip(dests, (size for size in lens if size >= 0)):
                if dest is None:
                    conn.skip(size)
                else:
                    conn.read_into(dest)
        if sums is not None:
            for j, size in enumerate(lens):
                if out[self.lo + j] is not None and self.checksum_of(j, self.targets[j][:size]) != sums[j]:
                    self.result.bad_checksum.append(self.lo + j)
                    out[self.lo + j] = None  # those bytes are not the value: a miss, as in GetOp


class ExistsOp(Operation):
    opcode = Opcode.EXISTS_BATCH

    def on_response(self, conn, meta, payload_len):
        flags = _expect_list(meta, "ex", self.hi - self.lo)
        prefix = meta.get("prefix")
        if not isinstance(prefix, int) or not 0 <= prefix <= self.hi - self.lo:
            raise errors.ProtocolError(f"EXISTS response has a bad prefix {prefix!r}")
        conn.skip(payload_len)
        self.result.values[self.lo : self.hi] = [bool(f) for f in flags]
        self.result.prefixes[self.lo] = prefix


class RemoveOp(Operation):
    opcode = Opcode.REMOVE_BATCH

    def on_response(self, conn, meta, payload_len):
        statuses = _expect_list(meta, "st", self.hi - self.lo)
        conn.skip(payload_len)
        # OR with an earlier attempt's answer: a retry after a dropped connection
        # re-sends frames already answered, and those keys are now NOT_FOUND.
        earlier = self.result.values[self.lo : self.hi]
        self.result.values[self.lo : self.hi] = [
            bool(was) or st == RemoveStatus.REMOVED for was, st in zip(earlier, statuses)
        ]


class MetaOp(Operation):
    """PING / STATS: an empty request map; the answer is the response map."""

    def __init__(self, opcode: Opcode, result: BatchResult):
        super().__init__(result)
        self.opcode = opcode

    def request_meta_bytes(self, epoch: int | None) -> bytes:
        return b"\x80"  # msgpack {}: PING and STATS are answered whatever the epoch

    def response_bytes_max(self) -> int:
        return RESPONSE_BYTES_UNBOUNDED

    def on_response(self, conn, meta, payload_len):
        conn.skip(payload_len)
        self.result.meta = meta
