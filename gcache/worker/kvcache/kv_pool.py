"""Paged KV memory: a page allocator, the dual (full / SWA) pools, a request's page tables.

Full-attention layers keep KV for every page of a request (O(N)); SWA layers only need
the pages covering the last W tokens (O(W)), so they draw from a separate, smaller pool.
Page i of a request covers tokens [i*ps, (i+1)*ps) in both pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gcache.common.attention import AttentionKind
from gcache.worker import backend
from gcache.worker.config import ModelConfig
from gcache.worker.integrity import require

PAGES_MAX = 1 << 31  # page ids are stored as int32 in the engine's tables


class PagePool:
    """Free list of page ids [0, num_pages): O(1) alloc and free, strict ownership checks."""

    def __init__(self, num_pages: int, name: str) -> None:
        if not isinstance(num_pages, int) or not 0 <= num_pages < PAGES_MAX:
            raise ValueError(f"pool {name!r}: num_pages must be an int in [0, {PAGES_MAX}), got {num_pages!r}")
        self.name = name
        self.num_pages = num_pages
        # Pop from the end; reversed so fresh pools hand out 0, 1, 2, ... (easy to read in logs).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated = np.zeros(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing changes) when fewer than n are free."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"pool {self.name!r}: alloc count must be a non-negative int, got {n!r}")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        self._allocated[pages] = True
        return pages

    def free(self, pages) -> None:
        """Return pages; ValueError (nothing changes) on an unknown, duplicate or free page."""
        pages = [int(p) for p in pages]
        if not pages:
            return
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"pool {self.name!r}: unknown page {p} (pool has {self.num_pages})")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pool {self.name!r}: page listed twice in one free: {pages}")
        freed = [p for p in pages if not self._allocated[p]]
        if freed:
            raise ValueError(f"pool {self.name!r}: double free of page {freed[0]}")
        self._allocated[pages] = False
        self._free.extend(pages)

    def is_allocated(self, page: int | np.integer) -> bool:
        page = int(page)
        if not 0 <= page < self.num_pages:
            raise ValueError(f"pool {self.name!r}: unknown page {page}")
        return bool(self._allocated[page])

    def check_integrity(self) -> None:
        """Every page is either on the free list exactly once or allocated, never both."""
        free = np.asarray(self._free, dtype=np.int64)
        require(free.size == 0 or (free.min() >= 0 and free.max() < self.num_pages), "free page out of range")
        counts = np.bincount(free, minlength=self.num_pages)
        require(counts.max(initial=0) <= 1, f"pool {self.name!r}: a page is on the free list twice")
        require(np.array_equal(counts == 0, self._allocated), f"pool {self.name!r}: free list and bitmap disagree")


class DualKVCache:
    """The two paged KV pools of a hybrid model.

    k_full/v_full: [n_full_layers, full.num_pages, ps, kv_heads, head_dim]
    k_swa/v_swa:   [n_swa_layers,  swa.num_pages,  ps, kv_heads, head_dim]
    A model with no layers of one kind still has that pool (zero bytes per page), so page
    tables stay uniform for the tree and the engine.
    """

    def __init__(self, config: ModelConfig, full_pages: int, swa_pages: int, xp=None) -> None:
        xp = backend.xp if xp is None else xp
        self.xp = xp
        self.config = config
        self.page_size = config.page_size
        self.window = config.window
        self.full = PagePool(full_pages, AttentionKind.FULL)
        self.swa = PagePool(swa_pages, AttentionKind.SWA)
        tail = (config.page_size, config.kv_heads, config.head_dim)
        nf, ns = len(config.full_layers), len(config.swa_layers)
        self.k_full = xp.zeros((nf, full_pages) + tail, dtype=config.dtype)
        self.v_full = xp.zeros((nf, full_pages) + tail, dtype=config.dtype)
        self.k_swa = xp.zeros((ns, swa_pages) + tail, dtype=config.dtype)
        self.v_swa = xp.zeros((ns, swa_pages) + tail, dtype=config.dtype)
        # global layer id -> (pool kind, index among that kind's layers)
        self.layer_slot = {l: (AttentionKind.FULL, j) for j, l in enumerate(config.full_layers)}
        self.layer_slot.update({l: (AttentionKind.SWA, j) for j, l in enumerate(config.swa_layers)})

    @staticmethod
    def page_bytes(config: ModelConfig, kind: AttentionKind) -> int:
        """Bytes of K+V one page holds across all layers of `kind`."""
        if kind not in (AttentionKind.FULL, AttentionKind.SWA):
            raise ValueError(f"kind must be 'full' or 'swa', got {kind!r}")
        n = len(config.full_layers if kind == AttentionKind.FULL else config.swa_layers)
        return 2 * n * config.page_size * config.kv_heads * config.head_dim * config.itemsize

    def bytes_per_page(self, kind: AttentionKind) -> int:
        return self.page_bytes(self.config, kind)

    @classmethod
    def pages_for_budget(cls, config: ModelConfig, budget_bytes: int, swa_full_ratio: float) -> tuple[int, int]:
        """(full_pages, swa_pages) with full*bf + swa*bs <= budget and swa ~= ratio * full.

        swa_full_ratio = SWA pages / full pages (SGLang's --swa-full-tokens-ratio).
        """
        if not isinstance(budget_bytes, (int, np.integer)) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        if not swa_full_ratio > 0:
            raise ValueError(f"swa_full_ratio must be > 0, got {swa_full_ratio!r}")
        bf, bs = cls.page_bytes(config, AttentionKind.FULL), cls.page_bytes(config, AttentionKind.SWA)
        full = int(budget_bytes // (bf + swa_full_ratio * bs))
        swa = int(full * swa_full_ratio) if bs else full  # free SWA pages: no reason to ration
        while full * bf + swa * bs > budget_bytes:  # float rounding can overshoot by a page
            full, swa = full - 1, max(0, int((full - 1) * swa_full_ratio) if bs else full - 1)
        return full, swa

    @classmethod
    def from_budget(cls, config: ModelConfig, budget_bytes: int, swa_full_ratio: float, xp=None) -> DualKVCache:
        full, swa = cls.pages_for_budget(config, budget_bytes, swa_full_ratio)
        return cls(config, full, swa, xp)

    def total_bytes(self) -> int:
        return self.full.num_pages * self.bytes_per_page(AttentionKind.FULL) + self.swa.num_pages * self.bytes_per_page(
            AttentionKind.SWA
        )

    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.swa.check_integrity()


@dataclass
class RequestKV:
    """One request's page tables: full_pages[i] / swa_pages[i] hold page i of the sequence.

    swa_pages[i] is None where the SWA KV was freed (out of the window) or never loaded
    (a prefix-cache hit brings SWA only for its last W tokens). Pages with index <
    owned_from belong to someone else (the prefix tree): this request never frees them.
    """

    page_size: int
    window: int
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int | None] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose KV is written
    owned_from: int = 0

    @classmethod
    def from_prefix(cls, page_size: int, window: int, prefix_len: int, full_pages, swa_pages) -> RequestKV:
        """Start at a cached, page-aligned prefix whose pages the tree owns."""
        n = prefix_len // page_size
        if prefix_len % page_size or len(full_pages) != n or len(swa_pages) != n:
            raise ValueError("prefix must be page-aligned with one full and one swa entry per page")
        req = cls(page_size, window, list(full_pages), list(swa_pages), prefix_len, prefix_len // page_size)
        missing = [i for i in req.swa_window_pages(prefix_len) if req.swa_pages[i] is None]
        if missing:
            raise ValueError(f"prefix of {prefix_len} tokens lacks SWA KV for its window pages {missing}")
        return req

    @property
    def num_pages(self) -> int:
        return len(self.full_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def swa_window_start(self, length: int) -> int:
        """First page still needed by SWA at sequence length `length`: covers [length-W, length)."""
        return max(0, (length - self.window) // self.page_size)

    def swa_window_pages(self, length: int) -> range:
        return range(self.swa_window_start(length), self.pages_for(length))

    def grow(self, kv: DualKVCache, num_tokens: int) -> bool:
        """Allocate full + SWA pages so the table covers num_tokens; all-or-nothing."""
        need = self.pages_for(num_tokens) - self.num_pages
        if need <= 0:
            return True
        full = kv.full.alloc(need)
        if full is None:
            return False
        swa = kv.swa.alloc(need)
        if swa is None:
            kv.full.free(full)
            return False
        self.full_pages.extend(full)
        self.swa_pages.extend(swa)
        return True

    def shrink(self, kv: DualKVCache, num_tokens: int) -> None:
        """Drop the KV of positions >= num_tokens (rejected speculative drafts): the tables
        end at the page that covers num_tokens, and the pages past it that this request owns
        go back to the pools (the tree's leading pages are never freed)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"shrink to {num_tokens} tokens: the request has KV for {self.num_tokens}")
        self.num_tokens = num_tokens
        keep = max(self.pages_for(num_tokens), self.owned_from)
        if self.num_pages > keep:
            kv.full.free(self.full_pages[keep:])
            kv.swa.free([p for p in self.swa_pages[keep:] if p is not None])
            del self.full_pages[keep:]
            del self.swa_pages[keep:]

    def swa_out_of_window(self, length: int | None = None) -> list[int]:
        """Page indices this request owns whose SWA KV lies wholly before the window."""
        end = self.swa_window_start(self.num_tokens if length is None else length)
        return [i for i in range(self.owned_from, min(end, self.num_pages)) if self.swa_pages[i] is not None]

    def free_swa_out_of_window(self, kv: DualKVCache, length: int | None = None) -> int:
        """Return out-of-window SWA pages this request owns to the pool; count freed."""
        idx = self.swa_out_of_window(length)
        kv.swa.free([self.swa_pages[i] for i in idx])
        for i in idx:
            self.swa_pages[i] = None
        return len(idx)

    def release(self, kv: DualKVCache) -> None:
        """Free every page this request owns (index >= owned_from) and clear the tables."""
        start = self.owned_from
        kv.full.free(self.full_pages[start:])
        kv.swa.free([p for p in self.swa_pages[start:] if p is not None])
        self.full_pages, self.swa_pages, self.num_tokens, self.owned_from = [], [], 0, 0

    def held_pages(self) -> tuple[int, int]:
        """(full, swa) live pages in the tables, owned or shared."""
        return len(self.full_pages), sum(p is not None for p in self.swa_pages)

    def held_bytes(self, kv: DualKVCache) -> int:
        f, s = self.held_pages()
        return f * kv.bytes_per_page(AttentionKind.FULL) + s * kv.bytes_per_page(AttentionKind.SWA)
