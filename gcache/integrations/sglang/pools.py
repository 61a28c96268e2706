"""One SGLang host pool as the backend sees it: where each page's entries lie.

SGLang's host pools describe a page's bytes with `get_page_buffer_meta(indices)`:
(pointers, sizes), several entries per page. The backend asks once, for one
page, how many entries a page has and how large each is, registers the pool's
memory with the client, and from then on turns `host_indices` into pointers that
`batch_get_into` / `batch_put_from` read and write in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gcache.integrations.sglang.keys import KeyLayoutError, PoolKeys, dtypes_word, entry_parts
from gcache.wire.keys import KeyBuilder

# SGLang's host pools and torch tensors are untyped here (no stubs): Any.


def pool_tensors(host_pool: Any) -> list[Any]:
    """The host tensors a pool's page pointers point into (Mooncake registers the same)."""
    getter = getattr(host_pool, "get_hybrid_pool_buffer", None)
    tensors = getter() if getter is not None else [getattr(host_pool, "kv_buffer", None)]
    return [t for t in tensors if t is not None and t.numel() > 0]


def tensor_bytes(tensor: Any, writable: bool) -> np.ndarray:
    """A CPU tensor's bytes as a 1-D uint8 numpy array over the same memory (no copy)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"the GCache backend moves host (CPU) tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        if writable:  # a copy would receive the bytes and be thrown away
            raise ValueError("cannot read into a non-contiguous tensor")
        tensor = tensor.contiguous()
    out: np.ndarray = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return out


def is_logical(host_pool: Any) -> bool:
    """A hybrid model's logical anchor pool owns indices but no bytes."""
    return getattr(host_pool, "kv_buffer", None) is None and not pool_tensors(host_pool)


class PoolPages:
    """Entry geometry and keys of one host pool."""

    def __init__(self, host_pool: Any, pool_name: object, builder: KeyBuilder) -> None:
        self.host_pool = host_pool
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if not ptrs or len(ptrs) != len(sizes) or not all(isinstance(p, int) for p in ptrs):
            raise KeyLayoutError(
                f"pool {pool_name!s}: get_page_buffer_meta gave {len(ptrs)} pointers and "
                f"{len(sizes)} sizes for one page; the GCache backend needs one int pointer "
                "and size per entry"
            )
        self.entry_sizes = [int(s) for s in sizes]
        split_kv = getattr(host_pool, "v_buffer", None) is not None
        self.dtypes = dtypes_word(pool_tensors(host_pool))
        self.keys = PoolKeys(builder, pool_name, host_pool.layout, entry_parts(len(ptrs), split_kv), self.dtypes)
        self.page_bytes = sum(self.entry_sizes)

    @property
    def per_page(self) -> int:
        return self.keys.per_page

    def pages_in(self, host_indices: Any) -> int:
        n = int(host_indices.numel())
        if n % self.page_size:
            raise ValueError(f"{n} host indices are not whole pages of {self.page_size} tokens")
        return n // self.page_size

    def locate(self, page_hashes: list[str], host_indices: Any) -> tuple[list[bytes], list[int], list[int]]:
        """(entry keys, pointers, sizes) for these pages at these host slots."""
        pages = self.pages_in(host_indices)
        if pages != len(page_hashes):
            raise ValueError(f"{len(page_hashes)} page keys but host indices for {pages} pages")
        ptrs, sizes = self.host_pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * self.per_page:
            raise ValueError(
                f"get_page_buffer_meta gave {len(ptrs)} entries for {pages} pages (expected {self.per_page} per page)"
            )
        return self.keys.entries(page_hashes), ptrs, sizes
