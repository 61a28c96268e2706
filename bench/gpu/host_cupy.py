"""A stand-in cupy made of host memory: just enough of cupy for gcache's CupyBackend
(gcache/client/device/arrays.py) and bench/store/gpu_check.py, for the GPU check's dry run
(bench/gpu/check.py --dry-run) and tests/client/test_device_buffers.py.

"Device" arrays are numpy arrays behind `__cuda_array_interface__`. memcpyAsync copies at once,
and refuses a copy whose host side is not pinned memory (from alloc_pinned_memory) or whose
direction does not match its kind, so swapped arguments fail as they would on a GPU.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np


class HostArray:
    """A stand-in cupy.ndarray: host memory behind __cuda_array_interface__ (stream 1: legacy)."""

    def __init__(self, host: np.ndarray, readonly: bool = False):
        self.host = host
        self.readonly = readonly

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = dict(self.host.__array_interface__)
        cai["data"] = (cai["data"][0], self.readonly)
        cai.update(version=3, stream=1)
        return cai

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.host.ctypes.data)

    @property
    def size(self) -> int:
        return self.host.size

    def __getitem__(self, key):
        return HostArray(self.host[key])


class HostCupy:
    """`.module` is the stand-in cupy module; `.copies` counts copies by kind (1: H2D, 2: D2H)."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self):
        self.pinned: list[tuple[int, int]] = []
        self._alive: list[bytearray] = []
        self.copies = {1: 0, 2: 0}
        self.waited_on: set = set()
        rt = types.SimpleNamespace(
            memcpyHostToDevice=1,
            memcpyDeviceToHost=2,
            CUDARuntimeError=self.CUDARuntimeError,
            getDeviceCount=lambda: 1,
            getDeviceProperties=lambda i: {"name": b"host memory (stand-in cupy)"},
            memcpyAsync=self._memcpy,
            eventRecord=lambda ev, stream: self.waited_on.add(stream),
            streamWaitEvent=lambda stream, ev: None,
        )
        nothing = types.SimpleNamespace(ptr=0, synchronize=lambda: None, record=lambda stream=None: None)
        cuda = types.SimpleNamespace(
            runtime=rt,
            alloc_pinned_memory=self._alloc_pinned,
            get_current_stream=lambda: nothing,
            Stream=lambda non_blocking=False: types.SimpleNamespace(ptr=7, synchronize=lambda: None),
            Event=lambda disable_timing=False: types.SimpleNamespace(
                ptr=9, record=lambda stream=None: None, synchronize=lambda: None
            ),
            Device=lambda: types.SimpleNamespace(id=0),
        )
        self.module = types.ModuleType("cupy")
        self.module.__dict__.update(
            __version__="stand-in",
            cuda=cuda,
            uint8=np.uint8,
            asarray=lambda a: HostArray(np.array(a, copy=True)),
            zeros=lambda n, dtype=np.uint8: HostArray(np.zeros(n, dtype)),
            empty=lambda n, dtype=np.uint8: HostArray(np.empty(n, dtype)),
            asnumpy=lambda a: a.host.copy(),
        )

    def _alloc_pinned(self, nbytes: int):
        memory = bytearray(nbytes)
        start = np.frombuffer(memory, np.uint8).ctypes.data
        self.pinned.append((start, start + nbytes))
        # Kept alive here: freed "pinned" memory reused for an ordinary array would
        # look pinned to _is_pinned and fail a correct copy.
        self._alive.append(memory)
        return memory

    def _is_pinned(self, ptr: int, n: int) -> bool:
        return any(a <= ptr and ptr + n <= b for a, b in self.pinned)

    def _memcpy(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        host, dev = (src, dst) if kind == 1 else (dst, src)
        if not self._is_pinned(host, n) or self._is_pinned(dev, n):
            raise self.CUDARuntimeError(f"memcpyAsync kind {kind}: host side not pinned, or device side pinned")
        ctypes.memmove(dst, src, n)
        self.copies[kind] += 1
