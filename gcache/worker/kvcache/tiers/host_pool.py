"""L2 memory: paged host buffers for the dual (full / SWA) pools, and page copies to and
from the device pools.

Layout is page-first: one page of one pool is one contiguous run of bytes
[K, V] x [layers of that kind] x [page_size, kv_heads, head_dim], so a page is one
store value (`batch_put_from` / `batch_get_into` take an address and a size, no
per-page Python copy). The device pools are layer-first ([layer, page, ...]), which is
what the attention kernels want; copies between them go page by page (device -> host,
all layers at once) or layer by layer (host -> device, so compute of layer i can start
as soon as layer i is in place).

With cupy the buffers are pinned host memory (cupyx.empty_pinned); with numpy both
tiers are host arrays and the code path is the same.
"""

from __future__ import annotations

import numpy as np

from gcache.common.attention import AttentionKind
from gcache.worker import backend
from gcache.worker.config import ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache, PagePool

KINDS = (AttentionKind.FULL, AttentionKind.SWA)


def _host_bytes(nbytes: int, xp) -> np.ndarray:
    if xp is not np:
        import cupyx  # type: ignore[import-not-found]

        return cupyx.empty_pinned((nbytes,), dtype=np.uint8)
    return np.zeros(nbytes, dtype=np.uint8)


class HostKVPool:
    """Page storage of L2. Slot ids come from one PagePool per kind; the pool does not
    know which page hash a slot holds (host_cache.HostCache does)."""

    def __init__(self, config: ModelConfig, full_pages: int, swa_pages: int, xp=None) -> None:
        xp = backend.xp if xp is None else xp
        self.config = config
        self.xp = xp
        self.page_bytes = {k: DualKVCache.page_bytes(config, k) for k in KINDS}
        self.pools = {
            AttentionKind.FULL: PagePool(full_pages, "l2-full"),
            AttentionKind.SWA: PagePool(swa_pages, "l2-swa"),
        }
        self.layers = {AttentionKind.FULL: len(config.full_layers), AttentionKind.SWA: len(config.swa_layers)}
        self._raw = {k: _host_bytes(self.pools[k].num_pages * self.page_bytes[k], xp) for k in KINDS}
        tail = (config.page_size, config.kv_heads, config.head_dim)
        # Typed views: [slot, K/V, layer of this kind, ps, kv_heads, head_dim].
        self.pages = {
            k: self._raw[k].view(config.dtype).reshape((self.pools[k].num_pages, 2, self.layers[k]) + tail)
            for k in KINDS
        }

    @classmethod
    def from_budget(cls, config: ModelConfig, budget_bytes: int, swa_full_ratio: float, xp=None) -> HostKVPool:
        full, swa = DualKVCache.pages_for_budget(config, budget_bytes, swa_full_ratio)
        return cls(config, full, swa, xp)

    # ---- addresses (for the store client) --------------------------------------------
    def buffer(self, kind: AttentionKind) -> np.ndarray:
        """The flat byte buffer of a kind (register it with the store client once)."""
        return self._raw[kind]

    def address(self, kind: AttentionKind, slot: int) -> int:
        return int(self._raw[kind].ctypes.data) + int(slot) * self.page_bytes[kind]

    def slot_view(self, kind: AttentionKind, slot: int) -> memoryview:
        b = self.page_bytes[kind]
        # numpy's stubs give ndarray the buffer protocol only for Python >= 3.12
        return memoryview(self._raw[kind])[int(slot) * b : (int(slot) + 1) * b]  # type: ignore[arg-type]

    def total_bytes(self) -> int:
        return sum(self.pools[k].num_pages * self.page_bytes[k] for k in KINDS)

    # ---- copies ------------------------------------------------------------------------
    def store_from_device(self, kv: DualKVCache, kind: AttentionKind, dev_pages: list[int], slots: list[int]) -> None:
        """Device pages -> host slots, every layer of `kind` (one gather per K and V)."""
        if not dev_pages or not self.layers[kind]:
            return
        k_pool, v_pool = (kv.k_full, kv.v_full) if kind == AttentionKind.FULL else (kv.k_swa, kv.v_swa)
        idx = np.asarray(dev_pages, dtype=np.int64)
        dst = self.pages[kind]
        s = np.asarray(slots, dtype=np.int64)
        # [layer, n, ...] -> [n, layer, ...]
        dst[s, 0] = backend.to_numpy(k_pool[:, kv.xp.asarray(idx)]).swapaxes(0, 1)
        dst[s, 1] = backend.to_numpy(v_pool[:, kv.xp.asarray(idx)]).swapaxes(0, 1)

    def load_layer(
        self, kv: DualKVCache, kind: AttentionKind, layer_index: int, dev_pages: list[int], slots: list[int]
    ) -> None:
        """Host slots -> device pages for one layer of `kind` (its index among that kind)."""
        if not dev_pages:
            return
        k_pool, v_pool = (kv.k_full, kv.v_full) if kind == AttentionKind.FULL else (kv.k_swa, kv.v_swa)
        idx = kv.xp.asarray(np.asarray(dev_pages, dtype=np.int64))
        s = np.asarray(slots, dtype=np.int64)
        pages = self.pages[kind]
        k_pool[layer_index, idx] = kv.xp.asarray(pages[s, 0, layer_index])
        v_pool[layer_index, idx] = kv.xp.asarray(pages[s, 1, layer_index])
