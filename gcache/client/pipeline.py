"""Sends a batch's frames back to back on one connection and reads answers in order.

Deadlock rule: a new frame may join frames already in flight only while the
requests in flight are small (the server can always buffer them) or their
responses are small (we can always buffer those). Otherwise we first read the
oldest response. One frame alone can never deadlock: the server reads all of it
before it answers.

A STALE_EPOCH answer stops sending; the frames already in flight are read (the
node refuses them too, or serves them if its epoch did not rise for them), so
the connection stays in sync, and then StaleEpochError is raised.
"""

from __future__ import annotations

from collections import deque
from itertools import count

from gcache import errors
from gcache.client.connection import Connection
from gcache.client.operations import Operation
from gcache.wire.protocol import FLAG_RESPONSE, FrameStatus, Opcode

# Bytes that kernel socket buffers absorb without blocking (default tcp_rmem is
# 128 KiB; half of it holds data).
IN_FLIGHT_WINDOW_BYTES = 64 * 1024

_request_ids = count(1)  # process-wide; next() on count is atomic under the GIL


def status_error(status: int, meta: dict, address: str) -> errors.GCacheError:
    """The exception for a non-OK frame status (docs/protocol.md, 'Frame status')."""
    error, kind_ = meta.get("error"), meta.get("kind")
    message = error if isinstance(error, str) else ""
    kind = kind_ if isinstance(kind_, str) else ""
    where = f"gcache-server at {address}"
    if status == FrameStatus.BUSY:
        return errors.ServerBusyError(
            f"{where} is at its connection limit ({message}); retry later, lower pool_size, "
            "or raise the server's --connections-max",
            address,
        )
    if status == FrameStatus.SHUTTING_DOWN:
        return errors.ServerShuttingDownError(f"{where} is shutting down: {message}", address)
    if status == FrameStatus.LIMIT_EXCEEDED:
        return errors.LimitExceededError(
            f"{where} refused a request over its limits: {message}; send smaller batches "
            "(Client batch_keys_max / frame_payload_bytes_max)",
            kind,
            status,
        )
    if status in (FrameStatus.BAD_FRAME, FrameStatus.BAD_VERSION, FrameStatus.UNKNOWN_OPCODE):
        return errors.ProtocolError(
            f"{where} rejected a frame ({FrameStatus(status).name}, {kind}): {message}; "
            "the client and server versions may not match"
        )
    if status == FrameStatus.STALE_EPOCH:
        epoch = meta.get("epoch")
        map_bytes = meta.get("map")
        return errors.StaleEpochError(
            f"{where} has a newer cluster map (epoch {epoch}) than this request; nothing was "
            "done: the cluster client refreshes its map and retries",
            epoch if isinstance(epoch, int) else 0,
            bytes(map_bytes) if isinstance(map_bytes, (bytes, bytearray)) else b"",
        )
    if status == FrameStatus.UNAUTHENTICATED:
        return errors.AuthError(
            f"{where} requires authentication and refused this connection ({message}); pass "
            "token=... to gcache.Client (or set GCACHE_TOKEN) with a token of the node's --auth-file",
            "unauthenticated",
            address,
        )
    if status == FrameStatus.FORBIDDEN:
        return errors.AuthError(f"{where} refused the request: {message}", "forbidden", address)
    if status == FrameStatus.INTERNAL:
        return errors.ServerError(f"{where} failed internally ({kind}): {message}; check the server log", kind, status)
    return errors.ProtocolError(f"{where} answered with unknown frame status {status}: {message}")


def _receive(conn: Connection, request_id: int, op: Operation) -> list[Operation] | None:
    """Reads one response into `op`; returns the operations to send next: its halves,
    if the server refused `op` as over its limits and `op` can be split, or its
    follow-ups (a RESERVE's COMMIT)."""
    opcode, flags, rid, meta_len, status, payload_len = conn.read_header()
    meta = conn.read_meta(meta_len)
    if status != FrameStatus.OK:
        if status == FrameStatus.STALE_EPOCH and rid == request_id and opcode == op.opcode and payload_len == 0:
            raise status_error(status, meta, conn.address)  # the frame was read whole: in sync
        if status == FrameStatus.LIMIT_EXCEEDED and rid == request_id and opcode == op.opcode and payload_len == 0:
            halves = op.split()  # GETs only: the server kept the connection open
            if halves is not None:
                return halves
            if op.opcode == Opcode.GET_BATCH:  # one key, still over: stored under larger limits
                conn.broken = True
                raise errors.LimitExceededError(
                    f"gcache-server at {conn.address} cannot send the value of key {op.keys[0]!r} "
                    f"in one frame ({meta.get('error')}); it was stored under a larger "
                    "--value-bytes-max: raise the server's --frame-payload-bytes-max",
                    "LIMIT_EXCEEDED",
                    status,
                )
        conn.broken = True  # the rest of the stream is not worth resynchronising
        raise op.explain_error(status_error(status, meta, conn.address), status, meta)
    if rid != request_id or opcode != op.opcode or not flags & FLAG_RESPONSE:
        conn.broken = True
        raise errors.ProtocolError(
            f"gcache-server at {conn.address} answered request {rid} op {opcode}, "
            f"expected {request_id} op {int(op.opcode)}: responses are out of order"
        )
    op.on_response(conn, meta, payload_len)
    return op.follow_ups()


def run(conn: Connection, ops: list[Operation], depth_max: int, epoch: int | None = None) -> None:
    """Runs every operation on `conn`; on any exception the connection is marked
    broken, except StaleEpochError, raised only once the stream is in sync.

    `epoch`, when not None, is sent in every request map. An operation the
    server refuses as too large (a GET whose found values exceed its frame
    payload limit) is replaced by its two halves, sent on the same connection.
    Each split halves a key range, so a batch of n keys is split at most n - 1
    times; a single key that is still refused raises.
    """
    try:
        if len(ops) == 1:  # the common case: no bookkeeping
            request_id = next(_request_ids)
            parts, _ = ops[0].frame(request_id, epoch)
            conn.send(parts)
            halves = _receive(conn, request_id, ops[0])
            if halves is None:
                return
            ops = halves
        pending: deque = deque(ops)
        in_flight: deque = deque()
        request_bytes = 0
        response_bytes = 0
        stale: errors.StaleEpochError | None = None
        inserted = 0  # operations receive_oldest put at the front of `pending`

        def receive_oldest() -> None:
            nonlocal request_bytes, response_bytes, stale, inserted
            old_id, old_op, old_size, old_reply = in_flight.popleft()
            try:
                halves = _receive(conn, old_id, old_op)
            except errors.StaleEpochError as exc:
                if conn.broken:
                    raise
                stale = stale or exc
                halves = None
            if halves is not None and stale is None:
                pending.extendleft(reversed(halves))
                inserted += len(halves)
            request_bytes -= old_size
            response_bytes -= old_reply

        while (pending and stale is None) or in_flight:
            if not pending or stale is not None:
                receive_oldest()
                continue
            op = pending.popleft()
            request_id = next(_request_ids)
            parts, size = op.frame(request_id, epoch)
            reply_max = op.response_bytes_max()
            inserted_before = inserted
            while in_flight and not (
                len(in_flight) < depth_max
                and (
                    request_bytes + size <= IN_FLIGHT_WINDOW_BYTES
                    or response_bytes + reply_max <= IN_FLIGHT_WINDOW_BYTES
                )
            ):
                receive_oldest()
            if stale is not None:
                continue  # not sent: the node would refuse it too
            if inserted != inserted_before:
                # An answer brought operations that go first (a RESERVE's COMMIT):
                # `op` waits behind them (its frame is built again when it goes).
                pending.insert(inserted - inserted_before, op)
                continue
            conn.send(parts)
            in_flight.append((request_id, op, size, reply_max))
            request_bytes += size
            response_bytes += reply_max
        if stale is not None:
            raise stale
    except errors.StaleEpochError:
        raise  # _receive marked the connection broken if the stream was not in sync
    except BaseException:
        conn.broken = True
        raise
