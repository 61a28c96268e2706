"""Typed errors raised by the GCache client. Every message says what to do next.

Misses are never errors: a miss is `None` / `False` / a shorter prefix count.
`ConnectionError` and `TimeoutError` also subclass the builtins of the same
name, so `except ConnectionError:` works whichever one a caller imported.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A flag or config-file value is invalid; the message says which and why."""


class GCacheError(Exception):
    """Base class of every error the GCache client raises."""


class InvalidArgumentError(GCacheError, ValueError):
    """A call was given arguments it cannot use; nothing was sent."""


class KeyInvalidError(InvalidArgumentError):
    """A key is empty, longer than 512 bytes, or not bytes/str."""


class ValueTooLargeError(GCacheError):
    """The server refused a value larger than its --value-bytes-max.

    `keys` lists the refused keys; every other key of the batch was handled, and
    `results` holds the batch's per-key answers.
    """

    def __init__(self, message: str, keys: Iterable[bytes] = ()) -> None:
        super().__init__(message)
        self.keys = list(keys)
        self.results: list[Any] | None = None


class BufferTooSmallError(GCacheError):
    """A value is larger than the caller's buffer; that buffer was left untouched.

    `keys` lists the keys whose buffers were too small and `sizes` the value sizes
    they need; every other key of the batch was handled (`results`: per-key answers).
    """

    def __init__(self, message: str, keys: Iterable[bytes] = (), sizes: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.keys = list(keys)
        self.sizes = list(sizes)
        self.results: list[Any] | None = None


class ChecksumMismatchError(GCacheError):
    """Bytes did not match their checksum (XXH3, or xxh64 for older values): corrupted in transit or changed while sent.

    `keys` lists the affected keys; `results` holds the batch's per-key answers.
    """

    def __init__(self, message: str, keys: Iterable[bytes] = ()) -> None:
        super().__init__(message)
        self.keys = list(keys)
        self.results: list[Any] | None = None


class ProtocolError(GCacheError):
    """The peer sent a frame that breaks docs/protocol.md; the connection was dropped."""


class ServerError(GCacheError):
    """The server answered a request with an error status (see `kind`)."""

    def __init__(self, message: str, kind: str = "", status: int = 0):
        super().__init__(message)
        self.kind = kind
        self.status = status


class StaleEpochError(ServerError):
    """The node has a newer cluster map than the request's `epoch`; nothing was done.

    `epoch` is the node's epoch and `map_bytes` its cluster map (msgpack; empty
    if it has none). The cluster client adopts that map (or fetches one from a
    master) and retries; the single-node client raises this as it is. The
    connection stays usable.
    """

    def __init__(self, message: str, epoch: int = 0, map_bytes: bytes = b""):
        super().__init__(message, "stale_epoch", 8)
        self.epoch = epoch
        self.map_bytes = map_bytes


class LimitExceededError(ServerError):
    """A request went past a server limit (keys per batch, metadata or payload size)."""


class AuthError(GCacheError, PermissionError):
    """The node refused the credentials: no token, a wrong one, or one whose roles do not
    allow the call (`kind`: "unauthenticated" or "forbidden"). Not retried."""

    def __init__(self, message: str, kind: str = "unauthenticated", address: str = ""):
        super().__init__(message)
        self.kind = kind
        self.address = address


class ConnectionError(GCacheError, builtins.ConnectionError):
    """The server could not be reached or dropped the connection (retried already)."""

    def __init__(self, message: str, address: str = ""):
        super().__init__(message)
        self.address = address


class ServerBusyError(ConnectionError):
    """The server refused the connection: it is at --connections-max."""


class ServerShuttingDownError(ConnectionError):
    """The server is shutting down and refused the request."""


class TimeoutError(GCacheError, builtins.TimeoutError):
    """A socket wait made no progress within the client's timeout."""

    def __init__(self, message: str, address: str | None = "") -> None:
        super().__init__(message)
        self.address = address


class PoolExhaustedError(TimeoutError):
    """Every pooled connection stayed busy for the whole timeout."""


class ClientClosedError(GCacheError):
    """The client was closed; create a new gcache.Client."""


class TransportUnavailableError(GCacheError):
    """The transport asked for (transport="shm" or "rdma") cannot reach this server:
    not on the same host, no usable device, or refused by the server (e.g. with
    authentication on). The message says why; transport="tcp" always works."""
