"""gcache.Client: the one declared interface of every GCache client.

`Client("host:port")` is a ServerClient (one gcache-server, gcache.client.client);
`Client("gcache://master:port,...")` is a ClusterClient (gcache.client.cluster_client).
Both are subclasses, so `isinstance(Client(url), Client)` holds for either.
Method names follow Mooncake Store's `MooncakeDistributedStore`, so an engine
can swap stores. Misses are None / False; errors are gcache.errors exceptions.

A subclass provides the batch primitives (`_put_views`, `_get_views`,
`get_batch`, `batch_is_exist`, `batch_exists_prefix`, `batch_remove`, `ping`,
`stats`, `close`); the argument checking, buffer views and single-key forms
here are shared, so both answer the same inputs the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from gcache import errors
from gcache.client.buffers import BufferRegistry, byte_view, slice_view
from gcache.client.device import arrays as device_arrays
from gcache.client.device import staging as device_buffers
from gcache.wire.protocol import normalize_key, normalize_keys
from gcache.wire.worth import Worth, check_worth


def _is_address(obj) -> bool:
    return isinstance(obj, int) and not isinstance(obj, bool)


class Client(ABC):
    """A GCache client: one server ("host:port") or a cluster ("gcache://...").
    Thread-safe; use one per process. See ServerClient and ClusterClient for the
    constructor's options."""

    # Set by gcache.client.factory (which gcache.client imports): the implementation for an
    # address, so this contract imports none of its implementations.
    _implementation_for: ClassVar[Callable[[object, dict], type]]

    def __new__(cls, address="127.0.0.1:7600", *args, **kwargs):
        if cls is Client:  # pick the implementation; Python then runs its __init__
            return super().__new__(Client._implementation_for(address, kwargs))
        return super().__new__(cls)

    def __init__(self):
        self._registry = BufferRegistry()

    # -- what an implementation provides ---------------------------------------

    @abstractmethod
    def close(self) -> None:
        """Closes every connection; later calls raise ClientClosedError."""

    @abstractmethod
    def _put_views(
        self, keys: list[bytes], views: list[memoryview], worth: Sequence[Worth] | None = None
    ) -> list[bool]:
        """Stores views[i] under keys[i] (keys normalized, views checked); `worth`
        (checked), when given, goes in the PUT as its "worth" field."""

    @abstractmethod
    def _get_views(self, keys: list[bytes], views: list[memoryview]) -> list:
        """Reads each value into its view: per key its length, or None on a miss."""

    @abstractmethod
    def get_batch(self, keys) -> list:
        """Each value as bytes, or None on a miss."""

    @abstractmethod
    def batch_is_exist(self, keys) -> list[bool]:
        """Whether each key has a value."""

    @abstractmethod
    def batch_exists_prefix(self, keys) -> int:
        """How many leading keys exist (what HiCache's batch_exists needs)."""

    @abstractmethod
    def batch_remove(self, keys) -> list[bool]:
        """Removes each key; per key True if it existed."""

    @abstractmethod
    def ping(self) -> dict:
        """The server's (or every node's) PING answer."""

    @abstractmethod
    def stats(self) -> dict:
        """The server's (or every node's) STATS answer."""

    # -- lifecycle ------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _drop_device_staging(self) -> None:
        """Lets go of the pinned staging memory of device-array calls (closing clients)."""
        self.__dict__.pop("_device_staging", None)

    # -- buffers ----------------------------------------------------------------------

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
                        f"{what}: an address needs a size in bytes: {what}(key, address, size)"
                    )
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
            views: list[memoryview] = []
            cache: dict[int, memoryview] = {}
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
                f"{what}: with one buffer for all keys, pass offsets and sizes (one per key)"
            )
        if _is_address(buffers):
            return [self._registry.resolve(buffers + o, s, writable) for o, s in zip(offsets, sizes)]
        base = byte_view(buffers, writable)
        end = len(base)
        views = []
        append = views.append
        for o, s in zip(offsets, sizes):
            # slice_view's checks inlined for the common case; anything else gets its error
            if type(o) is int and type(s) is int and o >= 0 and s >= 0 and o + s <= end:
                append(base[o : o + s])
            else:
                append(slice_view(base, o, s, what))
        return views

    # -- puts -------------------------------------------------------------------------

    def put(self, key, value) -> bool:
        """Stores `value` (any bytes-like object). False: not admitted (no space), try later."""
        return self._put_views([normalize_key(key)], [byte_view(value, writable=False)])[0]

    def put_batch(self, keys, values, worth: Sequence[Worth] | None = None) -> list[bool]:
        """`worth`: per key (ValueKind, recompute cost), told to the node for its eviction
        (gcache.wire.worth; docs/protocol.md, "Value worth")."""
        keys = normalize_keys(keys)
        if len(values) != len(keys):
            raise errors.InvalidArgumentError(f"put_batch: {len(keys)} keys but {len(values)} values")
        if worth is not None:
            check_worth(worth, len(keys))
        return self._put_views(keys, [byte_view(v, writable=False) for v in values], worth)

    def put_from(self, key, buffer, offset: int = 0, size: int | None = None) -> bool:
        """Stores buffer[offset:offset+size] without copying it.

        `buffer` is any buffer-protocol object, or an int address inside a
        registered buffer; Mooncake's put_from(key, address, size) also works.
        A device (cupy) array is staged through pinned memory (device_buffers).
        """
        if device_arrays.is_device_array(buffer):
            return device_buffers.put_from(self, key, buffer, offset, size)
        view = self._view(buffer, offset, size, writable=False, what="put_from")
        return self._put_views([normalize_key(key)], [view])[0]

    def batch_put_from(
        self, keys, buffers, sizes=None, offsets=None, worth: Sequence[Worth] | None = None
    ) -> list[bool]:
        """Stores one slice per key: `buffers` is a list (buffers or addresses) or one buffer.
        `worth` as in put_batch (not carried for device arrays)."""
        if device_arrays.any_device_array(buffers):
            return device_buffers.batch_put_from(self, keys, buffers, sizes, offsets)
        keys = normalize_keys(keys)
        views = self._views(len(keys), buffers, sizes, offsets, writable=False, what="batch_put_from")
        if worth is not None:
            check_worth(worth, len(keys))
        return self._put_views(keys, views, worth)

    # -- gets -------------------------------------------------------------------------

    def get(self, key):
        """The value as bytes, or None on a miss. get_into avoids the copy into bytes."""
        return self.get_batch([key])[0]

    def get_into(self, key, buffer, offset: int = 0, size: int | None = None):
        """Reads the value into buffer[offset:offset+size]; returns its length, None on a miss.

        BufferTooSmallError if the value does not fit (the buffer is left untouched).
        A device (cupy) array is staged through pinned memory (device_buffers).
        """
        if device_arrays.is_device_array(buffer):
            return device_buffers.get_into(self, key, buffer, offset, size)
        view = self._view(buffer, offset, size, writable=True, what="get_into")
        return self._get_views([normalize_key(key)], [view])[0]

    def batch_get_into(self, keys, buffers, sizes=None, offsets=None) -> list:
        """Reads each value into its own slice; per key its length, or None on a miss."""
        if device_arrays.any_device_array(buffers):
            return device_buffers.batch_get_into(self, keys, buffers, sizes, offsets)
        keys = normalize_keys(keys)
        views = self._views(len(keys), buffers, sizes, offsets, writable=True, what="batch_get_into")
        return self._get_views(keys, views)

    def batch_get_scatter(self, keys, runs) -> list:
        """Reads each value straight into its runs (gcache.client.scatter.ScatterRuns):
        per key its length, or None (a miss, a bad checksum, a value of another size).
        Only a client of one server over the shm transport can; others raise
        TransportUnavailableError (see can_scatter)."""
        raise errors.TransportUnavailableError(f"{type(self).__name__} cannot read into scattered runs")

    @property
    def can_scatter(self) -> bool:
        """Whether batch_get_scatter works on this client."""
        return False

    # -- exists / remove -----------------------------------------------------------------

    def is_exist(self, key) -> bool:
        return self._exists_one(key)

    def _exists_one(self, key) -> bool:
        """is_exist's body: a client with a faster one-key path overrides this, not is_exist."""
        return self.batch_is_exist([key])[0]

    def remove(self, key) -> bool:
        """Removes a key; True if it existed. Removing a missing key is not an error."""
        return self.batch_remove([key])[0]
