"""Array backend: cupy on a GPU when it is installed, numpy otherwise; chosen once at start.

Set GCACHE_BACKEND=numpy to force the CPU path (or =cupy to require the GPU).
"""

from __future__ import annotations

import os
import types

import numpy as np


def _cupy_with_device() -> types.ModuleType | None:
    try:
        import cupy  # type: ignore[import-not-found]

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # not installed, no driver, no device: fall back to numpy
        return None
    return None


def select_backend(name: str | None = None) -> types.ModuleType:
    name = (name or os.environ.get("GCACHE_BACKEND", "auto")).lower()
    if name == "numpy":
        return np
    if name not in ("auto", "cupy"):
        raise ValueError(f"GCACHE_BACKEND must be auto, numpy or cupy, got {name!r}")
    cp = _cupy_with_device()
    if cp is None and name == "cupy":
        raise RuntimeError("GCACHE_BACKEND=cupy but cupy or a CUDA device is not available")
    return cp if cp is not None else np


xp = select_backend()


def to_numpy(a) -> np.ndarray:
    """Host copy of a backend array (no copy for numpy arrays)."""
    if isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)
    return get() if get is not None else np.asarray(a)


def backend_name(mod: types.ModuleType) -> str:
    return "numpy" if mod is np else mod.__name__
