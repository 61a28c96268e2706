"""ServerClient: the gcache.Client of one gcache-server (`gcache.Client("host:port")`).

Every call runs in the calling thread on a pooled connection (no hand-offs);
a batch larger than one frame is split and pipelined on that connection.
Every operation is idempotent (values are immutable, remove is idempotent), so
each is retried on a fresh connection when a connection fails.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from gcache import errors
from gcache.client import deadline as call_deadline
from gcache.client import native_core, one_key, pipeline
from gcache.client.api import Client
from gcache.client.connection import parse_address
from gcache.client.native_core import NativeCall, NativeExists, NativeGet, NativePut, NativeRemove
from gcache.client.operations import BatchResult, ExistsOp, MetaOp, RemoveOp
from gcache.client.pool import ConnectionPool
from gcache.client.scatter import ScatterLookupOp
from gcache.client.transports.choose import open_transport
from gcache.wire.auth import resolve_token
from gcache.wire.protocol import BATCH_KEYS_MAX, ChecksumKind, Opcode, normalize_key, normalize_keys
from gcache.wire.worth import Worth

RETRIES_MAX = 10
PIPELINE_DEPTH_MAX = 64
# One backoff sleep at most: retry_backoff_s doubles per attempt, and 10 s * 2^9
# would park a caller for over an hour.
RETRY_BACKOFF_MAX_S = 1.0


class ServerClient(Client):
    """Client of one gcache-server at "host:port" (made by gcache.Client("host:port")).
    Thread-safe; use one per process.

    timeout_s: the longest any socket wait may go without progress, and the
        longest a call waits for a free pooled connection (default
        TIMEOUT_S_DEFAULT, 5 s, as on the ClusterClient).
    call_timeout_s: the most one call may take in all, every attempt, wait and
        backoff included (gcache.client.deadline); when it runs out the call
        raises gcache.errors.TimeoutError. Default: timeout_s * (retries + 1).
    connect_timeout_s: the longest a new connection may take to open.
    pool_size: open connections at most (one per concurrently calling thread).
    retries: extra attempts, on a fresh connection, after a connection failure
        (refused, reset, closed). A timeout is not retried: the server made no
        progress for timeout_s, and retrying would only multiply the wait.
    retry_backoff_s: sleep before the first retry, doubling per retry, each
        sleep capped at min(RETRY_BACKOFF_MAX_S, timeout_s).
    verify_checksums: check every value read against its checksum (XXH3; xxh64 for older values).
    batch_keys_max / frame_payload_bytes_max: a batch is split into frames of
        at most this many keys / payload bytes (must not exceed the server's).
        A GET frame whose found values exceed the server's frame limit is split
        again on its LIMIT_EXCEEDED answer, on the same connection.
    pipeline_depth: frames in flight at once on one connection.
    epoch: the cluster-map epoch sent with every PUT/GET/EXISTS/REMOVE (settable
        later as `client.epoch`); None sends none. A node with a newer map
        refuses the call with StaleEpochError (not retried here; the connection
        stays usable). The cluster client sets it; standalone use leaves it None.
    token: the tenant token for a node with --auth-file (docs/security.md); None
        reads $GCACHE_TOKEN (or the file named by $GCACHE_TOKEN_FILE). Each new
        connection proves it with a challenge-response; the token is never sent.
        A missing or wrong token makes every call raise gcache.errors.AuthError.
    transport: how values move (gcache.client.transports.choose): "tcp" (in the
        frames), "shm" (same host: the server's arena mapped into this process,
        copied natively), "rdma" (one-sided RDMA reads and writes), or "auto"
        (default): shm when the server is on this host, else rdma when usable,
        else tcp. $GCACHE_TRANSPORT sets what "auto" means. `client.transport`
        names the one in use. Every method behaves the same on each.
    copy_threads: threads a one-sided copy may use (0 = by size, up to the cores).

    Calls run on the native client core (gcache.client.native_core: framing, the
    shared-memory cycle and the checksums in C++, the GIL released) over tcp and shm;
    $GCACHE_CLIENT_CORE=python forces the Python reference path. Where the core cannot
    serve (not built, rdma) a warning says so once and the reference path runs.

    An address "gcache://master:port[,master:port...]" gives a ClusterClient
    (gcache.client.cluster_client) instead: the same interface over a whole cluster.
    """

    def __init__(
        self,
        address: str = "127.0.0.1:7600",
        *,
        timeout_s: float = call_deadline.TIMEOUT_S_DEFAULT,
        call_timeout_s: float | None = None,
        connect_timeout_s: float = 1.0,
        pool_size: int = 8,
        retries: int = 2,
        verify_checksums: bool = False,
        batch_keys_max: int = 4096,
        frame_payload_bytes_max: int = 64 * 1024 * 1024,
        pipeline_depth: int = 8,
        retry_backoff_s: float = 0.01,
        epoch: int | None = None,
        token: str | None = None,
        transport: str = "auto",
        copy_threads: int = 0,
    ):
        parse_address(address)
        if token is not None and not isinstance(token, str):
            raise errors.InvalidArgumentError(f"token must be a str, got {type(token).__name__}")
        try:
            token = resolve_token(token)
        except ValueError as exc:
            raise errors.InvalidArgumentError(str(exc)) from None
        if not 0 < timeout_s <= 3600 or not 0 < connect_timeout_s <= 3600:
            raise errors.InvalidArgumentError("timeout_s and connect_timeout_s must be in (0, 3600]")
        if not 0 <= retries <= RETRIES_MAX:
            raise errors.InvalidArgumentError(f"retries must be in [0, {RETRIES_MAX}], got {retries}")
        call_timeout_s = call_deadline.call_timeout_for(timeout_s, retries, call_timeout_s)
        if not 1 <= batch_keys_max <= BATCH_KEYS_MAX:
            raise errors.InvalidArgumentError(f"batch_keys_max must be in [1, {BATCH_KEYS_MAX}]")
        if frame_payload_bytes_max < 1:
            raise errors.InvalidArgumentError("frame_payload_bytes_max must be >= 1")
        if not 1 <= pipeline_depth <= PIPELINE_DEPTH_MAX:
            raise errors.InvalidArgumentError(f"pipeline_depth must be in [1, {PIPELINE_DEPTH_MAX}]")
        if not 0 <= retry_backoff_s <= 10:
            raise errors.InvalidArgumentError("retry_backoff_s must be in [0, 10]")
        if not isinstance(copy_threads, int) or not 0 <= copy_threads <= 64:
            raise errors.InvalidArgumentError("copy_threads must be an int in [0, 64]")
        super().__init__()
        self.address = address
        self.timeout_s = timeout_s
        self.call_timeout_s = call_timeout_s
        self.retries = retries
        self.verify_checksums = verify_checksums
        self.batch_keys_max = batch_keys_max
        self.frame_payload_bytes_max = frame_payload_bytes_max
        self.pipeline_depth = pipeline_depth
        self.retry_backoff_s = retry_backoff_s
        self.epoch = epoch
        self._transport, first = open_transport(transport, address, timeout_s, connect_timeout_s, token, copy_threads)
        self._pool = ConnectionPool(self._transport.connect, pool_size, timeout_s)
        if first is not None:
            self._pool.adopt(first)
        self._native = native_core.usable_for(self._transport.name)
        if self._native:
            native_core.spin_us()  # a bad $GCACHE_CLIENT_SPIN_US is said here, not at a call

    # -- lifecycle ----------------------------------------------------------

    @property
    def transport(self) -> str:
        """The transport in use: "tcp", "shm" or "rdma"."""
        return self._transport.name

    def close(self) -> None:
        """Closes every pooled connection; later calls raise ClientClosedError."""
        self._pool.close()
        self._transport.close()
        self._drop_device_staging()

    def __repr__(self) -> str:
        return (
            f"gcache.Client({self.address!r}, transport={self._transport.describe()!r}, "
            f"open_connections={self._pool.open_count})"
        )

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int | None) -> None:
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**63):
            raise errors.InvalidArgumentError(f"epoch must be None or an int in [0, 2**63), got {epoch!r}")
        self._epoch = epoch

    # -- the retry loop -------------------------------------------------------

    def _run(
        self,
        ops: list | NativeCall,
        result: BatchResult,
        depth: int | None = None,
        deadline: call_deadline.Deadline | None = None,
        stale_retry: bool = True,
    ) -> None:
        """Runs the call's frames, retrying on a fresh connection as the class says.
        `deadline` and `stale_retry` continue a call gcache.client.one_key began (its
        deadline; whether the immediate retry after a stale idle connection is left)."""
        # One deadline for the whole call: a ClusterClient's (its part of a larger call),
        # else call_timeout_s from now. Every wait below is capped by it.
        current = call_deadline.current()
        if current is not None:
            self._run_until(ops, result, depth, current, stale_retry)
        else:
            with call_deadline.using(deadline or call_deadline.Deadline(self.call_timeout_s)) as deadline:
                self._run_until(ops, result, depth, deadline, stale_retry)

    def _run_until(
        self, ops: list | NativeCall, result: BatchResult, depth: int | None, deadline, stale_retry_left: bool
    ) -> None:
        epoch = self._epoch  # one epoch for every frame and retry of this call
        depth = min(depth or self.pipeline_depth, self._transport.pipeline_depth or self.pipeline_depth)
        attempt = 0
        while True:
            conn = None
            try:
                deadline.check(self.address, "waiting for a connection")
                conn = self._pool.acquire()
                conn.begin_call(deadline)
                if isinstance(ops, list):  # the reference path (a list's check, not the ABC's)
                    pipeline.run(conn, ops, depth, epoch)
                else:
                    ops.run(conn, epoch, depth)
                break
            except errors.ConnectionError as exc:
                self._pool.discard_idle()  # their server likely went away too
                if conn is not None and conn.reused and stale_retry_left:
                    # The server may have closed this idle pooled connection (idle
                    # timeout, restart): one immediate retry, not counted as an attempt.
                    stale_retry_left = False
                    result.reset()
                    continue
                backoff = self.backoff_s(attempt)
                if attempt >= self.retries or deadline.left() <= backoff:
                    raise type(exc)(f"{exc} (gave up after {attempt + 1} attempt(s))", self.address) from exc
                time.sleep(backoff)
                attempt += 1
                result.reset()
            finally:
                if conn is not None:
                    conn.end_call()
                    self._pool.release(conn)
        result.raise_problems(self.address)

    def backoff_s(self, attempt: int) -> float:
        """Sleep before retry `attempt` (0-based): doubling, capped by RETRY_BACKOFF_MAX_S and timeout_s."""
        return min(self.retry_backoff_s * (2**attempt), RETRY_BACKOFF_MAX_S, self.timeout_s)

    def _split(self, n: int, sizes=None, bytes_max: int | None = None) -> list[tuple[int, int]]:
        """[lo, hi) slices of at most batch_keys_max keys and `bytes_max` (default
        frame_payload_bytes_max) bytes."""
        if n == 1:  # one key is one frame whatever its size (a larger value is refused per key)
            return [(0, 1)]
        bytes_max = bytes_max or self.frame_payload_bytes_max
        if sizes is not None and n <= self.batch_keys_max and sum(sizes) <= bytes_max:
            return [(0, n)]  # the common case: the whole batch in one frame
        if sizes is None:
            step = self.batch_keys_max
            return [(lo, min(lo + step, n)) for lo in range(0, n, step)]
        slices, lo, total = [], 0, 0
        for i, size in enumerate(sizes):
            if i > lo and (i - lo >= self.batch_keys_max or total + size > bytes_max):
                slices.append((lo, i))
                lo, total = i, 0
            total += size
        if lo < n:
            slices.append((lo, n))
        return slices

    def _native_for(self, slices: list[tuple[int, int]]) -> bool:
        """Whether the native core runs a call of these frames: every call over shm (its
        RESERVE / COMMIT and LOOKUP cycles run frame after frame either way); over tcp a call
        of one frame, the common case, while the reference pipeline keeps several frames of
        one call in flight at once."""
        return self._native and (len(slices) == 1 or self._transport.name == "shm")

    # -- buffers --------------------------------------------------------------

    # -- puts -------------------------------------------------------------------

    def _put_views(
        self, keys: list[bytes], views: list[memoryview], worth: Sequence[Worth] | None = None
    ) -> list[bool]:
        """Stores views[i] under keys[i]; `worth` (per key) goes in each PUT_BATCH / RESERVE
        map as its "worth" field, sliced to the frame's keys, on either path."""
        result = BatchResult(keys)
        result.worth = worth
        if keys:
            sizes = [len(v) for v in views]
            chunk = min(self._transport.put_chunk_bytes or self.frame_payload_bytes_max, self.frame_payload_bytes_max)
            slices = self._split(len(keys), sizes, chunk)
            # A value over a chunk (one-sided puts): one frame at a time, so each
            # reservation may wait for room instead of queueing behind another.
            depth = 1 if self._transport.put_chunk_bytes and max(sizes) > chunk else None
            if self._native_for(slices):
                kind = int(getattr(self._transport, "put_kind", ChecksumKind.XXH3))  # shm: the arena's, per connection
                self._run(NativePut(result, slices, views, kind), result, depth)
            else:
                self._run(self._transport.put_ops(result, slices, views), result, depth)
        return result.values

    # -- gets -------------------------------------------------------------------

    def _get_ops(self, keys: list[bytes], result: BatchResult, targets=None) -> list | NativeCall:
        sizes = None if targets is None else [len(t) for t in targets]
        slices = self._split(len(keys), sizes)
        verify = self.verify_checksums
        if self._native_for(slices):
            transport = self._transport
            return NativeGet(result, slices, verify, targets, lambda s: transport.get_ops(result, s, verify, targets))
        return self._transport.get_ops(result, slices, verify, targets)

    def get(self, key):
        """The value as bytes, or None on a miss. get_into avoids the copy into bytes."""
        key = normalize_key(key)
        if self._native:
            value = one_key.get(self, key)
            if value is not one_key.NOT_TAKEN:
                return value
        return self._get_general(key)

    def _get_general(self, key: bytes, deadline: call_deadline.Deadline | None = None, stale_retry: bool = True):
        result = BatchResult([key])
        self._run(self._get_ops(result.keys, result), result, None, deadline, stale_retry)
        return result.values[0]

    def get_batch(self, keys) -> list:
        result = BatchResult(normalize_keys(keys))
        if result.keys:
            self._run(self._get_ops(result.keys, result), result)
        return result.values

    def _get_views(self, keys: list[bytes], views: list[memoryview]) -> list:
        result = BatchResult(keys)
        if keys:
            self._run(self._get_ops(keys, result, views), result)
        return result.values

    @property
    def can_scatter(self) -> bool:
        return self._transport.name == "shm"

    def batch_get_scatter(self, keys, runs) -> list:
        if not self.can_scatter:
            return super().batch_get_scatter(keys, runs)
        result = BatchResult(normalize_keys(keys))
        runs.check(len(result.keys))
        if result.keys:
            slices = self._split(len(result.keys), runs.sizes)
            self._run([ScatterLookupOp(result, lo, hi, runs, self.verify_checksums) for lo, hi in slices], result)
        return result.values

    # -- exists / remove ----------------------------------------------------------

    def _exists(
        self, keys: list[bytes], deadline: call_deadline.Deadline | None = None, stale_retry: bool = True
    ) -> BatchResult:
        result = BatchResult(keys)
        if keys:
            slices = self._split(len(keys))
            if self._native_for(slices):
                self._run(NativeExists(result, slices), result, None, deadline, stale_retry)
            else:
                self._run([ExistsOp(result, lo, hi) for lo, hi in slices], result, None, deadline, stale_retry)
        return result

    def _exists_one(self, key) -> bool:
        key = normalize_key(key)
        if self._native:
            found = one_key.exists(self, key)
            if found is not one_key.NOT_TAKEN:
                return found
        return self._exists([key]).values[0]

    def batch_is_exist(self, keys) -> list[bool]:
        return self._exists(normalize_keys(keys)).values

    def batch_exists_prefix(self, keys) -> int:
        """How many leading keys exist (what HiCache's batch_exists needs)."""
        result = self._exists(normalize_keys(keys))
        total = 0
        for lo, hi in self._split(len(result.keys)):
            total += result.prefixes[lo]
            if result.prefixes[lo] < hi - lo:
                break
        return total

    def batch_remove(self, keys) -> list[bool]:
        result = BatchResult(normalize_keys(keys))
        if result.keys:
            slices = self._split(len(result.keys))
            if self._native_for(slices):
                self._run(NativeRemove(result, slices), result)
            else:
                self._run([RemoveOp(result, lo, hi) for lo, hi in slices], result)
        return result.values

    # -- control ------------------------------------------------------------------

    def _meta_call(self, opcode: Opcode) -> dict:
        result = BatchResult([])
        self._run([MetaOp(opcode, result)], result)
        if result.meta is None:  # cannot happen: MetaOp read the answer's map
            raise RuntimeError("invariant broken: MetaOp read the answer's map")
        return result.meta

    def ping(self) -> dict:
        """{"version": str, "epoch": int, "map": bytes} from the server (map: its cluster
        map as msgpack, b"" if it has none); raises if it cannot be reached."""
        answer = self._meta_call(Opcode.PING)
        answer.setdefault("map", b"")
        return answer

    def stats(self) -> dict:
        """{"counters": {...}, "gauges": {...}, "histograms": {...}} from the server."""
        return self._meta_call(Opcode.STATS)
