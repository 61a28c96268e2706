"""SGLang's per-pool calls (batch_exists_v2 / batch_get_v2 / batch_set_v2), used by hybrid models.

A hybrid model (sliding-window attention, Mamba, ...) has a host pool per kind of
state: the full-attention KV pool (the anchor) plus e.g. an SWA pool with its own
slots. Each pool's pages go under their own keys (the pool word in the key: "swa"),
all pools of one call move in one store round trip, and a prefix is reported
restorable only when every pool can serve it (sglang_prefix.fold).
"""
from __future__ import annotations

import logging

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

from gcache.integrations.sglang.keys import pool_tag
from gcache.integrations.sglang.pools import PoolPages
from gcache.integrations.sglang.prefix import fold, leading_pages, pages_present

log = logging.getLogger("gcache.integrations.sglang")


class PerPoolCalls:
    """Mixed into GCacheHiCacheStorage: uses its _pages, _logical, store, _write, _safely."""

    def _pool(self, name) -> PoolPages | None:
        tag = pool_tag(name)
        if tag in self._logical:
            return None
        pages = self._pages.get(tag)
        if pages is None:
            raise ValueError(f"pool {name!s} was never registered (register_mem_host_pool_v2)")
        return pages

    def _exists_v2(self, keys, pool_transfers) -> PoolTransferResult:
        if not keys:
            return PoolTransferResult(0, {}, [])
        kv_logical = "full" in self._logical
        kv_keys, kv_per_page = ([], 1) if kv_logical else self._kv_entry_keys(keys)
        asks, spans = list(kv_keys), []
        for transfer in pool_transfers or []:
            pages = self._pool(transfer.name)
            entry_keys = pages.keys.entries(keys) if pages is not None else []
            spans.append((transfer, len(asks), len(entry_keys), pages))
            asks.extend(entry_keys)
        flags = self.store.exists_flags(asks) if asks else []  # one round trip for every pool
        kv_pages = len(keys) if kv_logical else \
            leading_pages(pages_present(flags[:len(kv_keys)], kv_per_page))
        pools = []
        for transfer, start, count, pages in spans:
            present = [True] * kv_pages if pages is None else \
                pages_present(flags[start:start + count], pages.per_page)[:kv_pages]
            window = len(transfer.keys) if transfer.keys else 1  # SGLang's trailing-window size
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            pools.append((transfer.name, policy, window, present))
        final, hits, restorable = fold(kv_pages, pools, kv_name=PoolName.KV)
        return PoolTransferResult(final, hits, restorable)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        return self._safely("batch_exists_v2", PoolTransferResult.empty(), self._exists_v2,
                            keys, pool_transfers)

    def _move_v2(self, transfers, writing: bool) -> dict:
        results, spans = {}, []
        all_keys, all_ptrs, all_sizes = [], [], []
        for transfer in transfers:
            page_hashes = transfer.keys or []
            try:
                pages = self._pool(transfer.name)
                if pages is None:  # a logical pool: no bytes to move
                    results[transfer.name] = [True] * len(page_hashes)
                    continue
                if not page_hashes:
                    results[transfer.name] = []
                    continue
                if transfer.host_indices is None:
                    raise ValueError("no host_indices")
                entry_keys, ptrs, sizes = pages.locate(page_hashes, transfer.host_indices)
            except Exception as exc:  # one bad transfer fails alone
                log.error("GCache backend: pool %s transfer refused: %s", transfer.name, exc)
                results[transfer.name] = [False] * len(page_hashes)
                continue
            spans.append((transfer.name, len(all_keys), len(entry_keys), pages.per_page))
            all_keys += entry_keys
            all_ptrs += ptrs
            all_sizes += sizes
        if spans:  # every pool's entries in one store call
            if writing:
                ok = self._write(all_keys, all_ptrs, all_sizes, 1)
            else:
                got = self.store.get_into(all_keys, all_ptrs, all_sizes)
                ok = [g is not None and g == s for g, s in zip(got, all_sizes)]
            for name, start, count, per_page in spans:
                results[name] = pages_present(ok[start:start + count], per_page)
        return results

    def _failed_v2(self, transfers) -> dict:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return self._safely("batch_get_v2", self._failed_v2(transfers), self._move_v2, transfers, False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._safely("batch_set_v2", self._failed_v2(transfers), self._move_v2, transfers, True)

