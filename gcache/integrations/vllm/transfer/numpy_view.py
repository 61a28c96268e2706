"""A numpy array seen as a KV view: what `page_runs` reads of a torch view (`shape`, `stride()`,
`element_size()`, `data_ptr()`), for the host paths that have no torch (the GPU check's dry run,
`bench.vllm.unit`, the unit tests)."""

from __future__ import annotations

import numpy as np


class NumpyView:
    """A `[blocks, heads, tokens, content]` numpy array (any strides) as page_runs reads a view."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape = array.shape

    def stride(self) -> tuple[int, ...]:
        """Strides in elements, as torch gives them."""
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return int(self.array.itemsize)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)
