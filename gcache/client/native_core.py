"""The native client core (gcache_native/client/core_*.cpp) behind ServerClient.

For one connection, TCP or shared memory, the core builds each request frame,
sends it, reads and parses the answer and moves the value bytes (the shared-memory
lease / copy / release cycle with each value's checksum fused into the copy; a TCP
PUT's values hashed on a helper thread ahead of the send), with the GIL released
for the whole frame. The Python operations (gcache.client.operations,
transports/shm_ops.py) stay as the reference: the tests run every call through
both and compare bytes, statuses, errors and misses.

What stays in Python for both paths: the pool, retries, the call's deadline, batch
splitting and the per-key problems (BatchResult). What this module adds: a `NativeCall`
per client call, which ServerClient runs where it would run the reference operations;
each maps a native failure onto the same gcache.errors the reference raises.

$GCACHE_CLIENT_CORE: "native" (default) or "python" (the reference path everywhere).
Where the native core cannot load, or for a transport it does not drive (rdma), the
client uses the reference path and says so once with a warning.
"""

from __future__ import annotations

import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from gcache import errors
from gcache.client import pipeline
from gcache.client.connection import Connection
from gcache.client.operations import _OLD_NODE_HINT, BatchResult, Operation, PutOp, record_put_statuses
from gcache.client.transports import shm_ops
from gcache.wire.protocol import ChecksumKind, FrameStatus, PutStatus, RemoveStatus, decode_meta
from gcache.wire.worth import worth_field

CORE_ENV = "GCACHE_CLIENT_CORE"  # "python": the reference path; "native" (default)
SPIN_ENV = "GCACHE_CLIENT_SPIN_US"
# A small request's answer comes within microseconds; blocking for it costs the kernel's
# sleep and wake-up. The core polls the socket this long first (a bounded spin), only after a
# request of at most 64 KiB (Channel::send).
SPIN_US_DEFAULT = 50.0
SPIN_US_MAX = 10_000.0
NATIVE_TRANSPORTS = ("tcp", "shm")
_NO_EPOCH = -1

try:
    from gcache._native import CoreArena, CoreConnection, CoreError
except ImportError as exc:  # a module built before the core: the reference path, said once
    CoreArena = CoreConnection = CoreError = None  # type: ignore[assignment,misc]
    _LOAD_ERROR: str | None = f"gcache._native has no client core ({exc})"
else:
    _LOAD_ERROR = None

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"gcache client: {reason}; using the Python reference path (slower per call)", RuntimeWarning, stacklevel=3
        )


def wanted() -> bool:
    """Whether the native core is asked for ($GCACHE_CLIENT_CORE, default native)."""
    choice = os.environ.get(CORE_ENV, "native").strip().lower()
    if choice not in ("native", "python", ""):
        raise errors.InvalidArgumentError(f"${CORE_ENV} must be 'native' or 'python', got {choice!r}")
    return choice != "python"


def usable_for(transport: str, core: str | None = None) -> bool:
    """Whether a client on `transport` runs its calls natively. `core` ("native" /
    "python"; None: $GCACHE_CLIENT_CORE) picks; when the native core is wanted but
    cannot serve, a warning says so once and the reference path is used."""
    if core is None:
        want = wanted()
    elif core in ("native", "python"):
        want = core == "native"
    else:
        raise errors.InvalidArgumentError(f"core must be 'native' or 'python', got {core!r}")
    if not want:
        return False
    if _LOAD_ERROR is not None:
        _warn_once(_LOAD_ERROR)
        return False
    if transport not in NATIVE_TRANSPORTS:
        _warn_once(f"the native client core does not drive transport {transport!r}")
        return False
    return True


def spin_us() -> float:
    """How long the core polls for a small request's answer before it blocks
    ($GCACHE_CLIENT_SPIN_US, default SPIN_US_DEFAULT; 0: never)."""
    raw = os.environ.get(SPIN_ENV, "")
    try:
        value = float(raw) if raw.strip() else SPIN_US_DEFAULT
    except ValueError:
        value = -1.0
    if not 0 <= value <= SPIN_US_MAX:
        raise errors.InvalidArgumentError(
            f"${SPIN_ENV} must be a number of microseconds in [0, {SPIN_US_MAX:g}], got {raw!r}"
        )
    return value


def native_arena(fd: int, size: int):
    """The core's own mapping of a server's arena (None without the core)."""
    return None if CoreArena is None else CoreArena(fd, size)


def encode_extra_entries(extra: dict | None) -> tuple[bytes, int]:
    """(msgpack key/value pairs, count) of extra request-map entries (e.g. a PUT's optional
    value description): the core appends them to the map as they are."""
    if not extra:
        return b"", 0
    import msgpack

    packed = msgpack.packb(extra, use_bin_type=True)
    head = packed[0]
    skip = 1 if 0x80 <= head <= 0x8F else 3 if head == 0xDE else 5
    return packed[skip:], len(extra)


def core_of(conn: Connection):
    core = conn.native
    if core is None:
        core = conn.native = CoreConnection(conn.sock.fileno())
        core.spin_us = spin_us()
        arena: Any = conn.arena  # a MappedArena: the core drives no other kind
        if arena is not None:  # what the one-key calls (gcache.client.one_key) read through
            core.bind_arena(arena.native, arena.lease_s * shm_ops.LEASE_TRUST, arena.threads)
    return core


def _deadline_left(conn: Connection, doing: str) -> float:
    """Caps the socket's waits by the call's deadline, as the reference does before a
    wait; returns the seconds left of it (-1: none)."""
    if conn._pos != conn._end:  # cannot happen: every answer is read whole
        conn.broken = True
        raise errors.ProtocolError(f"connection to {conn.address} holds unread bytes")
    deadline = conn.deadline
    if deadline is None:
        return -1.0
    left = deadline.left()
    if left < conn.timeout_s:  # near the deadline (or past it: raises TimeoutError)
        conn._cap_wait(doing)
    return max(0.0, left)


def failure(conn: Connection, exc: Exception, doing: str, op: Operation | None = None) -> Exception:
    """The gcache error the reference path raises for the same failure."""
    kind, message, err, status, meta_bytes, in_sync = exc.args
    if kind == "timeout":  # no progress for the socket's timeout (capped by the deadline), as the reference
        return conn._fail(BlockingIOError(), doing)
    if kind == "closed":
        return conn._closed_by_peer(doing)
    if kind == "os":
        return conn._fail(OSError(err, message), doing)
    conn.broken = True
    if kind == "arena_closed":
        instance = getattr(conn.arena, "instance", "?")
        return errors.ClientClosedError(
            f"the arena mapping of gcache-server instance {instance} was closed "
            "(its client closed, or the node left the cluster map)"
        )
    if kind == "status":
        meta = decode_meta(meta_bytes) if meta_bytes else {}
        error = pipeline.status_error(status, meta, conn.address)
        if status == FrameStatus.STALE_EPOCH and in_sync:
            conn.broken = False  # the frame was read whole: the stream is in sync
        return op.explain_error(error, status, meta) if op is not None else error
    return errors.ProtocolError(f"gcache-server at {conn.address}: {message}")


class NativeCall(ABC):
    """One client call's frames (slices of its batch), run by the native core on one
    connection. `run` is what ServerClient's retry loop calls in place of pipeline.run."""

    doing = "waiting for a response"

    def __init__(self, result: BatchResult, slices: list[tuple[int, int]]):
        self.result = result
        self.slices = slices

    def run(self, conn: Connection, epoch: int | None, depth: int) -> None:
        core = core_of(conn)
        e = _NO_EPOCH if epoch is None else epoch
        for k, (lo, hi) in enumerate(self.slices):
            try:
                self.run_slice(core, conn, k, lo, hi, e)
            except CoreError as exc:
                if self.fall_back(conn, exc, lo, hi, epoch, depth):
                    continue
                raise failure(conn, exc, self.doing, self.reference_op(lo, hi)) from None

    @abstractmethod
    def run_slice(self, core, conn: Connection, k: int, lo: int, hi: int, epoch: int) -> None:
        """Runs keys [lo, hi) (slice k) and writes their answers into the result."""

    def reference_op(self, lo: int, hi: int) -> Operation | None:
        """The reference operation of a slice, for explaining a refused frame."""
        return None

    def fall_back(self, conn: Connection, exc: Exception, lo: int, hi: int, epoch: int | None, depth: int) -> bool:
        """Whether the slice was then run by the reference path (a frame it can split)."""
        return False


class NativeGet(NativeCall):
    """GET_BATCH (tcp) or LOOKUP + copy + RELEASE (shm): into `targets` or as bytes."""

    def __init__(self, result, slices, verify: bool, targets, reference: Callable[[list], list]):
        super().__init__(result, slices)
        self.verify = verify
        self.targets = targets
        self.reference = reference  # slices -> the reference operations (for a split)

    def run_slice(self, core, conn, k, lo, hi, epoch):
        targets = None if self.targets is None else self.targets[lo:hi]
        arena = conn.arena
        left = _deadline_left(conn, self.doing)
        if arena is None:
            values, too_small, bad = core.get(self.result.keys[lo:hi], targets, self.verify, epoch, left)
        else:
            trusted_s = arena.lease_s * shm_ops.LEASE_TRUST  # the share of a lease a copy may rely on
            values, too_small, bad = core.get(
                self.result.keys[lo:hi], targets, self.verify, epoch, left, arena.native, trusted_s, arena.threads
            )
        result = self.result
        result.values[lo:hi] = values
        if too_small:
            result.too_small.extend((lo + j, size) for j, size in too_small)
        if bad:
            result.bad_checksum.extend(lo + j for j in bad)

    def fall_back(self, conn, exc, lo, hi, epoch, depth):
        kind, _message, _err, status, _meta, in_sync = exc.args
        if kind != "status" or status != FrameStatus.LIMIT_EXCEEDED or not in_sync or hi - lo < 2:
            return False
        # Found values over the node's frame limit: the reference splits the frame on the same connection.
        pipeline.run(conn, self.reference([(lo, hi)]), depth, epoch)
        return True


class NativePut(NativeCall):
    """PUT_BATCH (tcp, large values' sums trailing them) or RESERVE + copy + COMMIT (shm)."""

    doing = "sending a request"

    def __init__(self, result, slices, views: list, kind: int):
        super().__init__(result, slices)
        self.views = views
        self.kind = kind

    def run_slice(self, core, conn, k, lo, hi, epoch):
        arena = conn.arena
        left = _deadline_left(conn, self.doing)
        worth = self.result.worth  # the frame's keys' part of the PUT's "worth" field
        extra, count = encode_extra_entries(None if worth is None else {"worth": worth_field(worth[lo:hi])})
        if arena is None:
            statuses, ck = core.put(self.result.keys[lo:hi], self.views[lo:hi], self.kind, epoch, extra, count, left)
            if (
                self.kind != ChecksumKind.XXH64
                and statuses
                and not ck
                and all(st == PutStatus.CHECKSUM_MISMATCH for st in statuses)
            ):
                conn.broken = True  # as the reference (pipeline.run marks it)
                # a node from before XXH3 checked XXH3 sums as xxh64
                raise errors.ProtocolError(f"every value of this PUT failed its checksum: {_OLD_NODE_HINT}")
        else:
            last = len(self.slices) - 1
            statuses, _ = core.put(
                self.result.keys[lo:hi],
                self.views[lo:hi],
                int(arena.put_kind),
                epoch,
                extra,
                count,
                left,
                arena.native,
                k == 0,
                k == last,
                arena.threads,
            )
        record_put_statuses(self.result, lo, statuses)

    def reference_op(self, lo, hi):
        return PutOp(self.result, lo, hi, self.views[lo:hi], self.kind)


class NativeExists(NativeCall):
    def run_slice(self, core, conn, k, lo, hi, epoch):
        flags, prefix = core.exists(self.result.keys[lo:hi], epoch, _deadline_left(conn, self.doing))
        self.result.values[lo:hi] = flags
        self.result.prefixes[lo] = prefix


class NativeRemove(NativeCall):
    def run_slice(self, core, conn, k, lo, hi, epoch):
        statuses = core.remove(self.result.keys[lo:hi], epoch, _deadline_left(conn, self.doing))
        # OR with an earlier attempt's answer: a retry re-sends frames already answered.
        earlier = self.result.values[lo:hi]
        self.result.values[lo:hi] = [bool(was) or st == RemoveStatus.REMOVED for was, st in zip(earlier, statuses)]
