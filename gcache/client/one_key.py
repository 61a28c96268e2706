"""get() and is_exist() of one key on the native core, with the least Python per call.

A 4 KiB GET over shared memory is one round trip of about 10 us, and the general path's
Python around it (a BatchResult, a Deadline made current, the pool's checkout, a NativeGet,
the retry loop) was a quarter of it. Here the common case is one native call on an idle
pooled connection: the call's deadline goes to the core as seconds, the value comes back as
the answer.

Only a call that starts on the client itself takes this path (a ClusterClient's part of a
call carries its own deadline), only when call_timeout_s is at least timeout_s (so no socket
wait needs capping on the first attempt), and only on an idle connection (no wait, no
connect). Anything else is NOT_TAKEN: the caller runs the general path. A failure here goes
on in the general path as the retry loop would after the same failure on the same
connection, with the same deadline, so the documented contract (errors, timeouts, misses,
retries) is the same; tests/client/test_native_core.py checks it against the reference.
"""

from __future__ import annotations

import time

from gcache import errors
from gcache.client import deadline as call_deadline
from gcache.client import native_core
from gcache.client.operations import BatchResult

NOT_TAKEN = object()  # the general path must run the call
_NO_EPOCH = -1
_GET_DOING = native_core.NativeGet.doing
_EXISTS_DOING = native_core.NativeExists.doing


def _idle_connection(client):
    """An idle pooled connection of a client whose call may take this path, or None."""
    if call_deadline.current() is not None or client.call_timeout_s < client.timeout_s:
        return None
    return client._pool.take_idle()


def get(client, key: bytes):
    """client.get(key) for a normalized key: the value, None on a miss, or NOT_TAKEN."""
    started = time.monotonic()
    value, error = _on_idle_connection(
        client, _GET_DOING, lambda core, epoch: core.get_one(key, client.verify_checksums, epoch, client.call_timeout_s)
    )
    if error is not None:
        return client._get_general(key, _after_stale(client, started, error), stale_retry=False)
    if value is False:  # its bytes failed their checksum: a miss the caller hears of, as on the general path
        result = BatchResult([key])
        result.bad_checksum.append(0)
        result.raise_problems(client.address)
    return value


def exists(client, key: bytes):
    """client.is_exist(key) for a normalized key: a bool, or NOT_TAKEN."""
    started = time.monotonic()
    found, error = _on_idle_connection(
        client, _EXISTS_DOING, lambda core, epoch: core.exists_one(key, epoch, client.call_timeout_s)
    )
    if error is not None:
        return client._exists([key], _after_stale(client, started, error), stale_retry=False).values[0]
    return found


def _on_idle_connection(client, doing: str, call):
    """call(core, epoch) on an idle pooled connection: (its answer, None), (None, the failure
    as a gcache error), or (NOT_TAKEN, None) where the call may not take this path."""
    conn = _idle_connection(client)
    if conn is None:
        return NOT_TAKEN, None
    epoch = client._epoch
    try:
        return call(native_core.core_of(conn), _NO_EPOCH if epoch is None else epoch), None
    except native_core.CoreError as exc:
        return None, native_core.failure(conn, exc, doing)  # marks conn broken where the stream is
    finally:
        client._pool.release(conn)


def _after_stale(client, started: float, error: Exception) -> call_deadline.Deadline:
    """What the retry loop does after a reused connection failed (it may have been closed
    while idle): drop the other idle ones and retry at once, once, not counted as an attempt;
    the call's deadline still counts from its start. Any other failure is raised as it is."""
    if not isinstance(error, errors.ConnectionError):
        raise error
    client._pool.discard_idle()
    return call_deadline.Deadline.since(started, client.call_timeout_s)
