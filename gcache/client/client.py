"""gcache.Client: the Python client of one gcache-server.

Method names follow Mooncake Store's `MooncakeDistributedStore`, so an engine
can swap stores. Misses are None / False; errors are gcache.errors exceptions.
Every call runs in the calling thread on a pooled connection (no hand-offs);
a batch larger than one frame is split and pipelined on that connection.
Every operation is idempotent (values are immutable, remove is idempotent), so
each is retried on a fresh connection when a connection fails.
"""
from __future__ import annotations

import time

from gcache import errors
from gcache.auth import resolve_token
from gcache.client import pipeline
from gcache.client.buffers import BufferRegistry, byte_view, slice_view
from gcache.client.connection import parse_address
from gcache.client.operations import BatchResult, ExistsOp, MetaOp, RemoveOp
from gcache.client.pool import ConnectionPool
from gcache.client.transport_select import open_transport
from gcache.protocol import BATCH_KEYS_MAX, Opcode, normalize_key, normalize_keys

RETRIES_MAX = 10
PIPELINE_DEPTH_MAX = 64
# One backoff sleep at most: retry_backoff_s doubles per attempt, and 10 s * 2^9
# would park a caller for over an hour.
RETRY_BACKOFF_MAX_S = 1.0


def _is_address(obj) -> bool:
    return isinstance(obj, int) and not isinstance(obj, bool)


class Client:
    """Client of one gcache-server at "host:port". Thread-safe; use one per process.

    timeout_s: the longest any socket wait may go without progress, and the
        longest a call waits for a free pooled connection.
    connect_timeout_s: the longest a new connection may take to open.
    pool_size: open connections at most (one per concurrently calling thread).
    retries: extra attempts, on a fresh connection, after a connection failure
        (refused, reset, closed). A timeout is not retried: the server made no
        progress for timeout_s, and retrying would only multiply the wait.
    retry_backoff_s: sleep before the first retry, doubling per retry, each
        sleep capped at min(RETRY_BACKOFF_MAX_S, timeout_s).
    verify_checksums: check every value read against its xxh64.
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
    transport: how values move (gcache.client.transport_select): "tcp" (in the
        frames), "shm" (same host: the server's arena mapped into this process,
        copied natively), "rdma" (one-sided RDMA reads and writes), or "auto"
        (default): shm when the server is on this host, else rdma when usable,
        else tcp. $GCACHE_TRANSPORT sets what "auto" means. `client.transport`
        names the one in use. Every method behaves the same on each.
    copy_threads: threads a one-sided copy may use (0 = by size, up to the cores).

    An address "gcache://master:port[,master:port...]" gives a ClusterClient
    (gcache.client.cluster_client) instead: the same methods over a whole cluster.
    """

    def __new__(cls, address="127.0.0.1:7600", *args, **kwargs):
        if cls is Client and isinstance(address, str) and address.startswith("gcache://"):
            from gcache.client.cluster_client import ClusterClient
            return ClusterClient(address, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, address: str = "127.0.0.1:7600", *, timeout_s: float = 5.0,
                 connect_timeout_s: float = 1.0, pool_size: int = 8, retries: int = 2,
                 verify_checksums: bool = False, batch_keys_max: int = 4096,
                 frame_payload_bytes_max: int = 64 * 1024 * 1024, pipeline_depth: int = 8,
                 retry_backoff_s: float = 0.01, epoch: int | None = None, token: str | None = None,
                 transport: str = "auto", copy_threads: int = 0):
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
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.verify_checksums = verify_checksums
        self.batch_keys_max = batch_keys_max
        self.frame_payload_bytes_max = frame_payload_bytes_max
        self.pipeline_depth = pipeline_depth
        self.retry_backoff_s = retry_backoff_s
        self.epoch = epoch
        self._transport, first = open_transport(transport, address, timeout_s, connect_timeout_s,
                                                token, copy_threads)
        self._pool = ConnectionPool(self._transport.connect, pool_size, timeout_s)
        if first is not None:
            self._pool.adopt(first)
        self._registry = BufferRegistry()

    # -- lifecycle ----------------------------------------------------------

    @property
    def transport(self) -> str:
        """The transport in use: "tcp", "shm" or "rdma"."""
        return self._transport.name

    def close(self) -> None:
        """Closes every pooled connection; later calls raise ClientClosedError."""
        self._pool.close()
        self._transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"gcache.Client({self.address!r}, transport={self._transport.describe()!r}, "
                f"open_connections={self._pool.open_count})")

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int | None) -> None:
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)
                                  or not 0 <= epoch < 2 ** 63):
            raise errors.InvalidArgumentError(f"epoch must be None or an int in [0, 2**63), got {epoch!r}")
        self._epoch = epoch

    # -- the retry loop -------------------------------------------------------

    def _run(self, ops: list, result: BatchResult) -> None:
        epoch = self._epoch  # one epoch for every frame and retry of this call
        depth = min(self.pipeline_depth, self._transport.pipeline_depth or self.pipeline_depth)
        attempt = 0
        stale_retry_left = True
        while True:
            conn = None
            try:
                conn = self._pool.acquire()
                pipeline.run(conn, ops, depth, epoch)
                break
            except errors.ConnectionError as exc:
                self._pool.discard_idle()  # their server likely went away too
                if conn is not None and conn.reused and stale_retry_left:
                    # The server may have closed this idle pooled connection (idle
                    # timeout, restart): one immediate retry, not counted as an attempt.
                    stale_retry_left = False
                    result.reset()
                    continue
                if attempt >= self.retries:
                    raise type(exc)(f"{exc} (gave up after {attempt + 1} attempt(s))",
                                    self.address) from exc
                time.sleep(self.backoff_s(attempt))
                attempt += 1
                result.reset()
            finally:
                if conn is not None:
                    self._pool.release(conn)
        result.raise_problems(self.address)

    def backoff_s(self, attempt: int) -> float:
        """Sleep before retry `attempt` (0-based): doubling, capped by RETRY_BACKOFF_MAX_S and timeout_s."""
        return min(self.retry_backoff_s * (2 ** attempt), RETRY_BACKOFF_MAX_S, self.timeout_s)

    def _split(self, n: int, sizes=None, bytes_max: int | None = None) -> list[tuple[int, int]]:
        """[lo, hi) slices of at most batch_keys_max keys and `bytes_max` (default
        frame_payload_bytes_max) bytes."""
        bytes_max = bytes_max or self.frame_payload_bytes_max
        if sizes is None:
            step = self.batch_keys_max
            return [(lo, min(lo + step, n)) for lo in range(0, n, step)]
        slices, lo, total = [], 0, 0
        for i, size in enumerate(sizes):
            if i > lo and (i - lo >= self.batch_keys_max
                           or total + size > bytes_max):
                slices.append((lo, i))
                lo, total = i, 0
            total += size
        if lo < n:
            slices.append((lo, n))
        return slices

    # -- buffers --------------------------------------------------------------

    def register_buffer(self, buffer_or_ptr, size: int | None = None) -> int:
        """Registers memory that later calls may name by int address; returns 0 (Mooncake).

        Takes any buffer-protocol object (kept alive until unregistered) or an
        int address plus its size in bytes (the caller keeps that memory alive).
        """
        self._registry.register(buffer_or_ptr, size)
        return 0

    def unregister_buffer(self, buffer_or_ptr) -> int:
        """Forgets a registered buffer; returns 0, or -1 if it was not registered."""
        return 0 if self._registry.unregister(buffer_or_ptr) else -1

    def _view(self, buffer, offset, size, writable: bool, what: str) -> memoryview:
        if _is_address(buffer):
            if size is None:  # Mooncake's (key, buffer_ptr, size): the third argument is the size
                if not offset:
                    raise errors.InvalidArgumentError(
                        f"{what}: an address needs a size in bytes: {what}(key, address, size)")
                offset, size = 0, offset
            return self._registry.resolve(buffer + offset, size, writable)
        return slice_view(byte_view(buffer, writable), offset, size, what)

    def _views(self, n: int, buffers, sizes, offsets, writable: bool, what: str) -> list[memoryview]:
        """One view per key from a list of buffers/addresses, or slices of one buffer."""
        for name, seq in (("sizes", sizes), ("offsets", offsets)):
            if seq is not None and len(seq) != n:
                raise errors.InvalidArgumentError(f"{what}: {n} keys but {len(seq)} {name}")
        if isinstance(buffers, (list, tuple)):
            if len(buffers) != n:
                raise errors.InvalidArgumentError(f"{what}: {n} keys but {len(buffers)} buffers")
            views, cache = [], {}
            for i, buf in enumerate(buffers):
                offset = offsets[i] if offsets is not None else 0
                size = sizes[i] if sizes is not None else None
                if _is_address(buf):
                    if size is None:
                        raise errors.InvalidArgumentError(f"{what}: addresses need sizes")
                    views.append(self._registry.resolve(buf + offset, size, writable))
                    continue
                base = cache.get(id(buf))
                if base is None:
                    base = cache[id(buf)] = byte_view(buf, writable)
                views.append(slice_view(base, offset, size, what))
            return views
        if offsets is None or sizes is None:
            raise errors.InvalidArgumentError(
                f"{what}: with one buffer for all keys, pass offsets and sizes (one per key)")
        if _is_address(buffers):
            return [self._registry.resolve(buffers + o, s, writable) for o, s in zip(offsets, sizes)]
        base = byte_view(buffers, writable)
        return [slice_view(base, o, s, what) for o, s in zip(offsets, sizes)]

    # -- puts -------------------------------------------------------------------

    def _put_views(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        result = BatchResult(keys)
        if keys:
            chunk = self._transport.put_chunk_bytes or self.frame_payload_bytes_max
            slices = self._split(len(keys), [len(v) for v in views],
                                 min(chunk, self.frame_payload_bytes_max))
            self._run(self._transport.put_ops(result, slices, views), result)
        return result.values

    def put(self, key, value) -> bool:
        """Stores `value` (any bytes-like object). False: not admitted (no space), try later."""
        return self._put_views([normalize_key(key)], [byte_view(value, writable=False)])[0]

    def put_batch(self, keys, values) -> list[bool]:
        keys = normalize_keys(keys)
        if len(values) != len(keys):
            raise errors.InvalidArgumentError(f"put_batch: {len(keys)} keys but {len(values)} values")
        return self._put_views(keys, [byte_view(v, writable=False) for v in values])

    def put_from(self, key, buffer, offset: int = 0, size: int | None = None) -> bool:
        """Stores buffer[offset:offset+size] without copying it.

        `buffer` is any buffer-protocol object, or an int address inside a
        registered buffer; Mooncake's put_from(key, address, size) also works.
        """
        view = self._view(buffer, offset, size, writable=False, what="put_from")
        return self._put_views([normalize_key(key)], [view])[0]

    def batch_put_from(self, keys, buffers, sizes=None, offsets=None) -> list[bool]:
        """Stores one slice per key: `buffers` is a list (buffers or addresses) or one buffer."""
        keys = normalize_keys(keys)
        views = self._views(len(keys), buffers, sizes, offsets, writable=False, what="batch_put_from")
        return self._put_views(keys, views)

    # -- gets -------------------------------------------------------------------

    def _get_ops(self, keys: list[bytes], result: BatchResult, targets=None) -> list:
        sizes = None if targets is None else [len(t) for t in targets]
        return self._transport.get_ops(result, self._split(len(keys), sizes), self.verify_checksums, targets)

    def get(self, key):
        """The value as bytes, or None on a miss. get_into avoids the copy into bytes."""
        result = BatchResult([normalize_key(key)])
        self._run(self._get_ops(result.keys, result), result)
        return result.values[0]

    def get_batch(self, keys) -> list:
        result = BatchResult(normalize_keys(keys))
        if result.keys:
            self._run(self._get_ops(result.keys, result), result)
        return result.values

    def get_into(self, key, buffer, offset: int = 0, size: int | None = None):
        """Reads the value into buffer[offset:offset+size]; returns its length, None on a miss.

        BufferTooSmallError if the value does not fit (the buffer is left untouched).
        """
        view = self._view(buffer, offset, size, writable=True, what="get_into")
        result = BatchResult([normalize_key(key)])
        self._run(self._get_ops(result.keys, result, [view]), result)
        return result.values[0]

    def batch_get_into(self, keys, buffers, sizes=None, offsets=None) -> list:
        """Reads each value into its own slice; per key its length, or None on a miss."""
        keys = normalize_keys(keys)
        views = self._views(len(keys), buffers, sizes, offsets, writable=True, what="batch_get_into")
        result = BatchResult(keys)
        if keys:
            self._run(self._get_ops(keys, result, views), result)
        return result.values

    # -- exists / remove ----------------------------------------------------------

    def _exists(self, keys: list[bytes]) -> BatchResult:
        result = BatchResult(keys)
        if keys:
            self._run([ExistsOp(result, lo, hi) for lo, hi in self._split(len(keys))], result)
        return result

    def is_exist(self, key) -> bool:
        return self._exists([normalize_key(key)]).values[0]

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

    def remove(self, key) -> bool:
        """Removes a key; True if it existed. Removing a missing key is not an error.

        The final state is idempotent (the key is gone), the answer is not quite:
        if the connection drops after the server removed the key but before its
        answer arrived, the retry finds nothing and this returns False.
        """
        return self.batch_remove([key])[0]

    def batch_remove(self, keys) -> list[bool]:
        result = BatchResult(normalize_keys(keys))
        if result.keys:
            self._run([RemoveOp(result, lo, hi) for lo, hi in self._split(len(result.keys))], result)
        return result.values

    # -- control ------------------------------------------------------------------

    def _meta_call(self, opcode: Opcode) -> dict:
        result = BatchResult([])
        self._run([MetaOp(opcode, result)], result)
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
