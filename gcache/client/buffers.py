"""Caller buffers as flat byte memoryviews, and the registry behind int addresses.

Every zero-copy call works on a 1-D unsigned-byte memoryview over the caller's
memory, so sends and receives touch the caller's bytes directly. Mooncake-style
calls pass an int address instead; it must lie inside a registered buffer.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from typing import TypeVar

from gcache import errors

# numpy is imported where needed: it costs ~0.3 s, and the CLI never needs it.


def byte_view(obj, writable: bool) -> memoryview:
    """Any C-contiguous buffer-protocol object -> a 1-D 'B' memoryview over the same memory."""
    try:
        view = memoryview(obj)
    except TypeError:
        if isinstance(obj, str):
            raise errors.InvalidArgumentError("values are bytes, not str: encode text first (value.encode())") from None
        if hasattr(obj, "__cuda_array_interface__"):
            raise errors.InvalidArgumentError(
                "a GPU array goes only to get_into / batch_get_into / put_from / batch_put_from "
                "(staged through pinned host memory); other calls take host buffers"
            ) from None
        raise errors.InvalidArgumentError(
            f"{type(obj).__name__} does not expose the buffer protocol: pass bytes, bytearray, "
            "memoryview, a numpy array, or an int address of a registered buffer"
        ) from None
    if writable and view.readonly:
        raise errors.InvalidArgumentError(
            f"the target {type(obj).__name__} is read-only: pass a writable buffer "
            "(bytearray, numpy array, writable memoryview)"
        )
    if not view.c_contiguous:
        raise errors.InvalidArgumentError(
            "the buffer is not C-contiguous: pass a contiguous array (numpy.ascontiguousarray)"
        )
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError:  # formats memoryview cannot cast (e.g. complex); numpy can
        import numpy as np

        # numpy's stubs give ndarray the buffer protocol only for Python >= 3.12
        return memoryview(np.frombuffer(view, dtype=np.uint8))  # type: ignore[arg-type]


def view_address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


# A byte view, or a range standing for one (device/arrays.slice_range: the same checks, on addresses)
Sliced = TypeVar("Sliced", memoryview, range)


def slice_view(view: Sliced, offset: int, size: int | None, what: str) -> Sliced:
    """view[offset:offset+size] with bounds checked (size None = to the end)."""
    if not isinstance(offset, int) or offset < 0:
        raise errors.InvalidArgumentError(f"{what}: offset must be an int >= 0, got {offset!r}")
    if size is None:
        size = len(view) - offset
    if not isinstance(size, int) or size < 0:
        raise errors.InvalidArgumentError(f"{what}: size must be an int >= 0, got {size!r}")
    if offset + size > len(view):
        raise errors.InvalidArgumentError(
            f"{what}: offset {offset} + size {size} runs past the end of a {len(view)}-byte buffer"
        )
    if offset == 0 and size == len(view):
        return view
    return view[offset : offset + size]


class BufferRegistry:
    """Registered memory regions, found by address. Registering pins the object."""

    def __init__(self):
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[tuple[int, int, memoryview]] = []  # sorted by start

    def register(self, buffer_or_ptr, size: int | None = None) -> int:
        """Registers a buffer object, or raw memory at an int address (Mooncake style)."""
        if isinstance(buffer_or_ptr, int) and not isinstance(buffer_or_ptr, bool):
            if not isinstance(size, int) or size <= 0:
                raise errors.InvalidArgumentError(
                    "register_buffer(address, size) needs the size in bytes (> 0) of that memory"
                )
            if buffer_or_ptr <= 0:
                raise errors.InvalidArgumentError(f"invalid buffer address {buffer_or_ptr}")
            import numpy as np

            raw = (ctypes.c_uint8 * size).from_address(buffer_or_ptr)
            view = memoryview(np.ctypeslib.as_array(raw))  # type: ignore[arg-type]  # as in byte_view
            start = buffer_or_ptr
        else:
            view = byte_view(buffer_or_ptr, writable=False)
            if size is not None:
                view = slice_view(view, 0, size, "register_buffer")
            start = view_address(view)
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            self._starts.insert(i, start)
            self._regions.insert(i, (start, start + len(view), view))
        return start

    def unregister(self, buffer_or_ptr) -> bool:
        start = (
            buffer_or_ptr if isinstance(buffer_or_ptr, int) else view_address(byte_view(buffer_or_ptr, writable=False))
        )
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                del self._starts[i]
                del self._regions[i]
                return True
        return False

    def resolve(self, address: int, size: int, writable: bool) -> memoryview:
        """A memoryview over [address, address+size) inside one registered region."""
        if not isinstance(size, int) or size < 0:
            raise errors.InvalidArgumentError(f"size must be an int >= 0 with an address, got {size!r}")
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            # Regions may overlap: search left for one that covers the whole range.
            while i >= 0:
                start, end, view = self._regions[i]
                if start <= address and address + size <= end:
                    if writable and view.readonly:
                        raise errors.InvalidArgumentError(f"address {address:#x} lies in a read-only registered buffer")
                    return view[address - start : address - start + size]
                i -= 1
        raise errors.InvalidArgumentError(
            f"address {address:#x} (+{size} bytes) is not inside a registered buffer: "
            "call register_buffer(buffer) or register_buffer(address, size) first"
        )

    def __len__(self) -> int:
        return len(self._regions)
