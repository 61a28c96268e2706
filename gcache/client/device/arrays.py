"""Device (GPU) arrays as the client sees them, and the copies that touch them.

`device_range` turns any object with `__cuda_array_interface__` (cupy, numba, a
CUDA torch tensor) into an address range, refusing what cannot be copied as
one (not C-contiguous, read-only, masked). A `DeviceBackend` has the only calls
that touch a device: pinned allocation, async host <-> device copies, marks and
waits. `CupyBackend` runs them on a GPU; `HostMemoryBackend` runs them on host
memory, in stream order, so the staging code (gcache.client.device.staging) is
tested on a CPU exactly as it runs on a GPU.
"""

from __future__ import annotations

import ctypes
import math
import re
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from gcache import errors
from gcache.client.buffers import slice_view, view_address

_device_type: dict[type, bool] = {}  # type -> may its instances be device arrays


class DeviceUnavailableError(errors.GCacheError):
    """A device array was passed but device copies cannot run here (no cupy, no GPU)."""


# -- recognising and describing device arrays ---------------------------------------------


def _may_be_device(kind: type) -> bool:
    # A host buffer's type never has the attribute. A torch tensor's type has it,
    # and a CPU tensor raises AttributeError on the instance: instances decide.
    maybe = _device_type.get(kind)
    if maybe is None:
        maybe = _device_type[kind] = hasattr(kind, "__cuda_array_interface__")
    return maybe


def is_device_array(obj: object) -> bool:
    """True for an object exposing __cuda_array_interface__ (cheap for host buffers)."""
    return _may_be_device(type(obj)) and hasattr(obj, "__cuda_array_interface__")


def any_device_array(buffers: object) -> bool:
    """Does a get/put `buffers` argument (one buffer or a list) hold a device array?"""
    if isinstance(buffers, (list, tuple)):
        # By type first (C speed): a host batch of thousands of keys pays ~1 us per 100.
        if not any(map(_may_be_device, set(map(type, buffers)))):
            return False
        return any(map(is_device_array, buffers))
    return is_device_array(buffers)


class DeviceRange(NamedTuple):
    """`nbytes` bytes of device memory at `ptr`; `stream` is the producer's stream handle."""

    ptr: int
    nbytes: int
    stream: int | None = None


def device_range(obj: Any, writable: bool, what: str) -> DeviceRange:
    """The memory of a C-contiguous device array, from its __cuda_array_interface__."""
    cai = obj.__cuda_array_interface__
    if cai.get("mask") is not None:
        raise errors.InvalidArgumentError(f"{what}: masked device arrays are not supported")
    shape = tuple(cai["shape"])
    digits = re.match(r"\d+", cai["typestr"][2:])  # "<f4", "|u1", "<M8[ns]"
    if digits is None:
        raise errors.InvalidArgumentError(f"{what}: a device array of typestr {cai['typestr']!r} (no item size)")
    itemsize = int(digits.group())
    ptr, readonly = cai["data"]
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, tuple(strides), itemsize):
        raise errors.InvalidArgumentError(
            f"{what}: the device array is not C-contiguous: pass a contiguous array (cupy.ascontiguousarray)"
        )
    if writable and readonly:
        raise errors.InvalidArgumentError(f"{what}: the target device array is read-only")
    return DeviceRange(ptr, itemsize * math.prod(shape), cai.get("stream"))


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent == 0:
            return True
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def slice_range(rng: DeviceRange, offset: int, size: int | None, what: str) -> DeviceRange:
    # slice_view only needs len() and slicing: a range gives the same checks and messages.
    part = slice_view(range(rng.nbytes), offset, size, what)
    return DeviceRange(rng.ptr + part.start, len(part), rng.stream)


# -- the copy primitives -----------------------------------------------------------------


class DeviceBackend(ABC):
    """What staging needs from a device: pinned host memory and ordered async copies.

    Copies run in issue order (one stream). `mark()` names the point reached so
    far and `wait(mark)` blocks until every copy issued before it has run.
    """

    @abstractmethod
    def alloc_pinned(self, nbytes: int) -> memoryview:
        """`nbytes` of page-locked host memory as a writable 1-D byte memoryview."""

    @abstractmethod
    def copy_h2d_async(self, device_ptr: int, host: memoryview, nbytes: int) -> None:
        """Queues host[:nbytes] -> device_ptr."""

    @abstractmethod
    def copy_d2h_async(self, device_ptr: int, host: memoryview, nbytes: int) -> None:
        """Queues device_ptr -> host[:nbytes]."""

    @abstractmethod
    def synchronize(self) -> None:
        """Returns once every queued copy has run."""

    def mark(self) -> Any:
        """An opaque point in the copy order (an int on host memory, a CUDA event on a GPU)."""
        return None

    def wait(self, mark: Any) -> None:
        self.synchronize()

    def order_after(self, streams: set[int]) -> None:
        """Makes later copies wait for work already queued on the callers' streams."""


class HostMemoryBackend(DeviceBackend):
    """'Device' memory is host memory (a device pointer is a host address).

    Copies are memmoves queued like a stream's and run, in order, only when
    waited for, so staging code that reads a slot before its copy ran, or
    reuses a slot before its copy ran, gives wrong bytes instead of passing.
    """

    def __init__(self) -> None:
        self._queue: list[tuple[int, int, int, memoryview]] = []  # (dst, src, n, view kept alive)
        self._issued = 0
        self._ran = 0
        self.pinned_allocations: list[int] = []  # sizes, in order
        self.copies = 0

    def alloc_pinned(self, nbytes: int) -> memoryview:
        self.pinned_allocations.append(nbytes)
        return memoryview(bytearray(nbytes))

    def copy_h2d_async(self, device_ptr: int, host: memoryview, nbytes: int) -> None:
        self._push(device_ptr, view_address(host), nbytes, host)

    def copy_d2h_async(self, device_ptr: int, host: memoryview, nbytes: int) -> None:
        self._push(view_address(host), device_ptr, nbytes, host)

    def _push(self, dst: int, src: int, nbytes: int, keep: memoryview) -> None:
        if nbytes > len(keep):
            raise errors.InvalidArgumentError(f"copy of {nbytes} bytes over a {len(keep)}-byte host view")
        self._queue.append((dst, src, nbytes, keep))
        self._issued += 1
        self.copies += 1

    def mark(self) -> int:
        return self._issued

    def wait(self, mark: int) -> None:
        while self._ran < mark:
            dst, src, nbytes, _ = self._queue.pop(0)
            if nbytes:
                ctypes.memmove(dst, src, nbytes)
            self._ran += 1

    def synchronize(self) -> None:
        self.wait(self._issued)


class CupyBackend(DeviceBackend):
    """Pinned memory from cupy's pinned pool; copies on one non-blocking stream of the
    device current when it was created."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise DeviceUnavailableError(
                f"a device (GPU) array was passed, but cupy is not importable ({exc}): "
                "pip install cupy-cuda12x, or pass host buffers"
            ) from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDARuntimeError, or a CUDA library that does not load
            raise DeviceUnavailableError(
                f"a device array was passed, but CUDA is not usable: {type(exc).__name__}: {exc}"
            ) from None
        if count < 1:
            raise DeviceUnavailableError("a device array was passed, but no CUDA device is visible")
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._order_event = cupy.cuda.Event(disable_timing=True)  # reused by order_after

    def alloc_pinned(self, nbytes: int) -> memoryview:
        import numpy as np

        memory = self._cupy.cuda.alloc_pinned_memory(nbytes)
        # keeps `memory` alive; the ignore: numpy's stubs give ndarray the buffer protocol only for Python >= 3.12
        return memoryview(np.frombuffer(memory, np.uint8, nbytes))  # type: ignore[arg-type]

    def copy_h2d_async(self, device_ptr: int, host: memoryview, nbytes: int) -> None:
        self._runtime.memcpyAsync(
            device_ptr, view_address(host), nbytes, self._runtime.memcpyHostToDevice, self._stream.ptr
        )

    def copy_d2h_async(self, device_ptr: int, host: memoryview, nbytes: int) -> None:
        self._runtime.memcpyAsync(
            view_address(host), device_ptr, nbytes, self._runtime.memcpyDeviceToHost, self._stream.ptr
        )

    def synchronize(self) -> None:
        self._stream.synchronize()

    def mark(self) -> Any:  # a cupy.cuda.Event
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(self._stream)
        return event

    def wait(self, mark: Any) -> None:
        mark.synchronize()

    def order_after(self, streams: set[int]) -> None:
        # Our stream is non-blocking: it does not wait for the legacy default
        # stream by itself, so kernels still writing (or reading) the caller's
        # arrays must be waited for explicitly.
        # CAI v3 stream handles: 1 legacy default, 2 per-thread default, else a
        # cudaStream_t; the current cupy stream's ptr (0: legacy default) too.
        handles = set(streams) | {self._cupy.cuda.get_current_stream().ptr}
        for handle in handles:
            self._runtime.eventRecord(self._order_event.ptr, handle)
            self._runtime.streamWaitEvent(self._stream.ptr, self._order_event.ptr)


# -- staging -------------------------------------------------------------------------------
