"""Device (GPU) arrays in get_into / batch_get_into / put_from / batch_put_from.

A device array is any object with `__cuda_array_interface__` (cupy, numba, a
CUDA torch tensor), C-contiguous. Values reach it through pinned host memory,
over whichever transport the client uses: the client's host primitive reads
a chunk of keys into a slot of one pinned staging buffer, and the bytes go to
the device with an async copy on one stream while the next chunk is read into
the next slot. Puts run the other way, one chunk ahead: device -> slot copies
for chunk k+1 run while chunk k is being put.

Only the copy primitives of a `DeviceBackend` touch the device: `CupyBackend`
on a GPU, `HostMemoryBackend` (plain memmoves, run in stream order when waited
for) where there is none. Deciding, chunking and staging is the same code for
both, so the tests exercise on a CPU what runs on a GPU.

Results are those of host buffers: sizes (None on a miss) for gets, True/False
for puts, BufferTooSmallError / ChecksumMismatchError / ValueTooLargeError with
`.results` once every key was tried. Lists may mix host and device buffers. One
client's device calls take turns on its staging buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from gcache import errors
from gcache.client.device.arrays import (
    CupyBackend,
    DeviceBackend,
    DeviceRange,
    device_range,
    is_device_array,
    slice_range,
)
from gcache.client.operations import BatchResult
from gcache.common.units import MiB
from gcache.wire.protocol import normalize_key, normalize_keys

STAGING_BYTES_DEFAULT = 64 * MiB  # the server's default --value-bytes-max: any value fits
SLOT_BYTES_DEFAULT = 4 * MiB  # small enough that a 16 MiB batch overlaps reads and copies

_attach_lock = threading.Lock()

Item = memoryview | DeviceRange  # per key: a host view, or a device array's range


class StagingClient(Protocol):
    """What staging uses of a client (api.Client): its host primitives and its view rules.
    The staging itself rides on the client as `_device_staging` (api.Client drops it on close)."""

    def _get_views(self, keys: list[bytes], views: list[memoryview]) -> list[Any]: ...

    def _put_views(self, keys: list[bytes], views: list[memoryview], worth: Any = None) -> list[bool]: ...

    def _views(self, n: int, buffers: Any, sizes: Any, offsets: Any, writable: bool, what: str) -> list[memoryview]: ...


def _host(item: Item) -> memoryview:
    if isinstance(item, DeviceRange):
        raise RuntimeError("device staging: a device item was planned as a host buffer")
    return item


def _device(item: Item) -> DeviceRange:
    if not isinstance(item, DeviceRange):
        raise RuntimeError("device staging: a host buffer was planned as a device item")
    return item


class _Chunk(NamedTuple):
    indices: list[int]  # keys of the call
    offsets: list[int | None]  # per key: its offset in the slot, or None for a host buffer
    slot: int


class DeviceStaging:
    """One client's pinned staging buffer (allocated at first use), cut into slots."""

    def __init__(
        self, backend: DeviceBackend, staging_bytes: int = STAGING_BYTES_DEFAULT, slot_bytes: int = SLOT_BYTES_DEFAULT
    ):
        if not isinstance(staging_bytes, int) or not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise errors.InvalidArgumentError("staging_bytes and slot_bytes must be ints >= 1")
        if staging_bytes < 2 * slot_bytes:
            raise errors.InvalidArgumentError(
                "staging_bytes must hold two slots at least (one read or put while the other copies)"
            )
        self.backend = backend
        self.staging_bytes = staging_bytes
        self.slot_bytes = slot_bytes
        self.slot_count = staging_bytes // slot_bytes
        self._host: memoryview | None = None
        self._marks: list[Any] = [None] * self.slot_count  # per slot: the backend's mark of its last copies
        self._lock = threading.Lock()
        self.stats = {"calls": 0, "chunks": 0, "large": 0, "temporary_bytes": 0}

    def _staging(self) -> memoryview:
        if self._host is None:
            self._host = self.backend.alloc_pinned(self.staging_bytes)
        return self._host

    def _slot(self, slot: int, offset: int, nbytes: int) -> memoryview:
        base = slot * self.slot_bytes + offset
        return self._staging()[base : base + nbytes]

    def _plan(self, capacities: list[int | None]) -> tuple[list[_Chunk], list[int]]:
        """Chunks whose device items fit one slot, in key order, and the device items
        larger than a slot (staged one at a time). None capacity: a host buffer."""
        chunks: list[_Chunk] = []
        large: list[int] = []
        indices: list[int] = []
        offsets: list[int | None] = []
        used = 0
        for i, cap in enumerate(capacities):
            if cap is not None and cap > self.slot_bytes:
                large.append(i)
                continue
            if cap is not None and used + cap > self.slot_bytes:
                chunks.append(_Chunk(indices, offsets, len(chunks) % self.slot_count))
                indices, offsets, used = [], [], 0
            indices.append(i)
            offsets.append(None if cap is None else used)
            used += cap or 0
        if indices:
            chunks.append(_Chunk(indices, offsets, len(chunks) % self.slot_count))
        return chunks, large

    def _reuse(self, slot: int) -> None:
        """Waits until the copies that last used `slot` have run."""
        if self._marks[slot] is not None:
            self.backend.wait(self._marks[slot])
            self._marks[slot] = None

    def _begin(self, items: Sequence[Item]) -> None:
        self.stats["calls"] += 1
        self.backend.order_after({item.stream for item in items if isinstance(item, DeviceRange) and item.stream})

    def _end(self) -> None:
        self.backend.synchronize()  # nothing of this call is left in flight
        self._marks = [None] * self.slot_count

    # -- gets ---------------------------------------------------------------------

    def get_into(self, client: StagingClient, keys: list[bytes], targets: list[Item]) -> list[Any]:
        """Reads each key into its target (a host memoryview or a DeviceRange)."""
        final = BatchResult(keys)
        capacities = [t.nbytes if isinstance(t, DeviceRange) else None for t in targets]
        chunks, large = self._plan(capacities)
        with self._lock:
            self._begin(targets)
            try:
                for chunk in chunks:
                    self._get_chunk(client, final, chunk, targets)
                self.backend.synchronize()  # large values use the whole buffer
                self._marks = [None] * self.slot_count
                for i in large:
                    self._get_large(client, final, i, _device(targets[i]))
            finally:
                self._end()
        final.raise_problems(getattr(client, "address", "?"))
        return final.values

    def _get_chunk(
        self,
        client: StagingClient,
        final: BatchResult,
        chunk: _Chunk,
        targets: list[Item],
    ) -> None:
        self.stats["chunks"] += 1
        self._reuse(chunk.slot)
        views = [
            _host(targets[i]) if off is None else self._slot(chunk.slot, off, _device(targets[i]).nbytes)
            for i, off in zip(chunk.indices, chunk.offsets)
        ]
        sizes, _ = _call(client._get_views, final, chunk.indices, views, report_too_small=True)
        copies: list[list[int]] = []  # (device ptr, slot offset, bytes), merged where both sides are contiguous
        for i, off, size in zip(chunk.indices, chunk.offsets, sizes):
            final.values[i] = size
            if off is None or not size:
                continue
            ptr = _device(targets[i]).ptr
            if copies and copies[-1][0] + copies[-1][2] == ptr and copies[-1][1] + copies[-1][2] == off:
                copies[-1][2] += size
            else:
                copies.append([ptr, off, size])
        for ptr, off, size in copies:
            self.backend.copy_h2d_async(ptr, self._slot(chunk.slot, off, size), size)
        self._marks[chunk.slot] = self.backend.mark()

    def _get_large(self, client: StagingClient, final: BatchResult, i: int, target: DeviceRange) -> None:
        """A target larger than a slot: read into the whole buffer (values up to its
        size), or for a larger value into a temporary pinned buffer of its size."""
        self.stats["large"] += 1
        host = self._staging()[: min(target.nbytes, self.staging_bytes)]
        (size,), too_small = _call(client._get_views, final, [i], [host], report_too_small=False)
        if too_small and too_small[0] <= target.nbytes:
            # Fits the target, not the staging buffer. If the key was replaced by a
            # larger value since, this read reports that size as too small.
            needed = too_small[0]
            self.stats["temporary_bytes"] += needed
            host = self.backend.alloc_pinned(needed)
            (size,), _ = _call(client._get_views, final, [i], [host], report_too_small=True)
        elif too_small:
            final.too_small.append((i, too_small[0]))
        final.values[i] = size
        if size:
            self.backend.copy_h2d_async(target.ptr, host, size)
            self.backend.synchronize()  # the buffer is reused by the next large value

    # -- puts ---------------------------------------------------------------------

    def put_from(self, client: StagingClient, keys: list[bytes], sources: list[Item]) -> list[bool]:
        """Stores each source (a host memoryview or a DeviceRange) under its key."""
        final = BatchResult(keys)
        capacities = [s.nbytes if isinstance(s, DeviceRange) else None for s in sources]
        chunks, large = self._plan(capacities)
        with self._lock:
            self._begin(sources)
            try:
                staged = self._stage_put(chunks[0], sources) if chunks else ([], None)
                for k, chunk in enumerate(chunks):
                    views, mark = staged
                    if k + 1 < len(chunks):  # the next chunk's copies overlap this put
                        staged = self._stage_put(chunks[k + 1], sources)
                    self.backend.wait(mark)
                    answers, _ = _call(client._put_views, final, chunk.indices, views, report_too_small=True)
                    for i, ok in zip(chunk.indices, answers):
                        final.values[i] = ok
                self.backend.synchronize()
                self._marks = [None] * self.slot_count
                for i in large:
                    self._put_large(client, final, i, _device(sources[i]))
            finally:
                self._end()
        final.raise_problems(getattr(client, "address", "?"))
        return final.values

    def _stage_put(self, chunk: _Chunk, sources: list[Item]) -> tuple[list[memoryview], Any]:
        """Queues the device -> slot copies of one chunk: (its views, the mark to wait for)."""
        self.stats["chunks"] += 1
        self._reuse(chunk.slot)
        views: list[memoryview] = []
        run: list[int] | None = None  # [device ptr, slot offset, bytes] being merged
        for i, off in zip(chunk.indices, chunk.offsets):
            if off is None:
                views.append(_host(sources[i]))
                continue
            src = _device(sources[i])
            views.append(self._slot(chunk.slot, off, src.nbytes))
            if run and run[0] + run[2] == src.ptr and run[1] + run[2] == off:
                run[2] += src.nbytes
                continue
            if run and run[2]:
                self.backend.copy_d2h_async(run[0], self._slot(chunk.slot, run[1], run[2]), run[2])
            run = [src.ptr, off, src.nbytes]
        if run and run[2]:
            self.backend.copy_d2h_async(run[0], self._slot(chunk.slot, run[1], run[2]), run[2])
        return views, self.backend.mark()

    def _put_large(self, client: StagingClient, final: BatchResult, i: int, source: DeviceRange) -> None:
        self.stats["large"] += 1
        if source.nbytes <= self.staging_bytes:
            host = self._staging()[: source.nbytes]
        else:
            self.stats["temporary_bytes"] += source.nbytes
            host = self.backend.alloc_pinned(source.nbytes)
        self.backend.copy_d2h_async(source.ptr, host, source.nbytes)
        self.backend.synchronize()
        (ok,), _ = _call(client._put_views, final, [i], [host], report_too_small=True)
        final.values[i] = ok


def _call(
    method: Callable[[list[bytes], list[memoryview]], list[Any]],
    final: BatchResult,
    indices: list[int],
    views: list[memoryview],
    report_too_small: bool,
) -> tuple[list[Any], list[int]]:
    """method(keys, views), the client's host primitive (_get_views / _put_views).
    Per-key problems go into `final`, reported once the whole call is done as the
    host path does. Returns the answers and, when not reported, the too-small sizes."""
    keys = [final.keys[i] for i in indices]
    try:
        return method(keys, views), []
    except (errors.BufferTooSmallError, errors.ChecksumMismatchError, errors.ValueTooLargeError) as exc:
        problem = exc
    answers = problem.results
    if answers is None:  # the host primitives raise these with the batch's answers attached
        raise problem
    # Map the failed keys back to positions (a batch may name a key twice).
    free = [j for j, answer in enumerate(answers) if answer is None or answer is False]

    def take(key: bytes) -> int:
        for n, j in enumerate(free):
            if keys[j] == key:
                return indices[free.pop(n)]
        raise errors.ProtocolError(f"a failed key {key!r} is not among those asked for")

    too_small: list[int] = []
    if isinstance(problem, errors.BufferTooSmallError):
        for key, size in zip(problem.keys, problem.sizes):
            if report_too_small:
                final.too_small.append((take(key), size))
            else:
                too_small.append(size)
    elif isinstance(problem, errors.ChecksumMismatchError):
        final.bad_checksum.extend(take(key) for key in problem.keys)
    else:
        final.too_large.extend(take(key) for key in problem.keys)
    return answers, too_small


# -- the client's entry points ---------------------------------------------------------


def staging_for(client: StagingClient) -> DeviceStaging:
    """The client's staging (a CupyBackend one, made at its first device call)."""
    staging: DeviceStaging | None = getattr(client, "_device_staging", None)
    if staging is None:
        with _attach_lock:
            staging = getattr(client, "_device_staging", None)
            if staging is None:
                staging = DeviceStaging(CupyBackend())
                setattr(client, "_device_staging", staging)  # noqa: B010 (an attribute no Client declares)
    return staging


def attach(
    client: StagingClient,
    backend: DeviceBackend,
    staging_bytes: int = STAGING_BYTES_DEFAULT,
    slot_bytes: int = SLOT_BYTES_DEFAULT,
) -> DeviceStaging:
    """Gives `client` its own staging on `backend` (another size, or HostMemoryBackend)."""
    staging = DeviceStaging(backend, staging_bytes, slot_bytes)
    with _attach_lock:
        setattr(client, "_device_staging", staging)  # noqa: B010 (an attribute no Client declares)
    return staging


def _items(
    client: StagingClient,
    n: int,
    buffers: Any,
    sizes: Sequence[int] | None,
    offsets: Sequence[int] | None,
    writable: bool,
    what: str,
) -> list[Item]:
    """Per key a DeviceRange or a host memoryview, with the host path's rules and messages."""
    for name, seq in (("sizes", sizes), ("offsets", offsets)):
        if seq is not None and len(seq) != n:
            raise errors.InvalidArgumentError(f"{what}: {n} keys but {len(seq)} {name}")
    if not isinstance(buffers, (list, tuple)):
        if offsets is None or sizes is None:
            raise errors.InvalidArgumentError(
                f"{what}: with one buffer for all keys, pass offsets and sizes (one per key)"
            )
        base = device_range(buffers, writable, what)
        return [slice_range(base, o, s, what) for o, s in zip(offsets, sizes)]
    if len(buffers) != n:
        raise errors.InvalidArgumentError(f"{what}: {n} keys but {len(buffers)} buffers")
    items: list[Item] = []
    ranges: dict[int, DeviceRange] = {}  # id(array) -> its range: one __cuda_array_interface__ read per array
    for i, buf in enumerate(buffers):
        offset = offsets[i] if offsets is not None else 0
        size = sizes[i] if sizes is not None else None
        if is_device_array(buf):
            known = ranges.get(id(buf))
            if known is None:
                known = ranges[id(buf)] = device_range(buf, writable, what)
            items.append(slice_range(known, offset, size, what))
        else:
            items.append(client._views(1, [buf], None if size is None else [size], [offset], writable, what)[0])
    return items


def batch_get_into(
    client: StagingClient,
    keys: Sequence[bytes | str],
    buffers: Any,
    sizes: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
) -> list[Any]:
    keys = normalize_keys(keys)
    targets = _items(client, len(keys), buffers, sizes, offsets, True, "batch_get_into")
    return staging_for(client).get_into(client, keys, targets) if keys else []


def get_into(client: StagingClient, key: bytes | str, buffer: Any, offset: int = 0, size: int | None = None) -> Any:
    target = slice_range(device_range(buffer, True, "get_into"), offset, size, "get_into")
    return staging_for(client).get_into(client, [normalize_key(key)], [target])[0]


def batch_put_from(
    client: StagingClient,
    keys: Sequence[bytes | str],
    buffers: Any,
    sizes: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
) -> list[bool]:
    keys = normalize_keys(keys)
    sources = _items(client, len(keys), buffers, sizes, offsets, False, "batch_put_from")
    return staging_for(client).put_from(client, keys, sources) if keys else []


def put_from(client: StagingClient, key: bytes | str, buffer: Any, offset: int = 0, size: int | None = None) -> bool:
    source = slice_range(device_range(buffer, False, "put_from"), offset, size, "put_from")
    return staging_for(client).put_from(client, [normalize_key(key)], [source])[0]
