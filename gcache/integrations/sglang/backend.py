"""GCache as SGLang's HiCache L3 storage backend (sglang 0.5.23, `dynamic` backend).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "gcache",
            "module_path": "gcache.integrations.sglang",
            "class_name": "GCacheHiCacheStorage",
            "gcache_url": "127.0.0.1:7600", "interface_v1": 1}'

SGLang's StorageBackendFactory calls `GCacheHiCacheStorage(storage_config, kwargs)`,
then `register_mem_pool_host(host_pool)` (and `register_mem_host_pool_v2` per pool
for hybrid models), then `on_host_pools_registered()`. The store is contacted in
the constructor: a missing or unreachable store fails the attach with a clear
error. From then on no call raises: a store failure is a miss, a False, or a
shorter prefix (store.SGLangStore, over integrations.common.GuardedStore). Keys: keys.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, TypeVar

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolName, PoolTransferResult

from gcache.common.attention import AttentionKind
from gcache.integrations.common.connect import connect
from gcache.integrations.common.engine_boundary import EngineBoundary
from gcache.integrations.sglang.keys import PoolKeys, flat_page_keys, key_builder, pool_tag
from gcache.integrations.sglang.pools import PoolPages, is_logical, pool_tensors, tensor_bytes
from gcache.integrations.sglang.prefix import fold, leading_pages, pages_present
from gcache.integrations.sglang.settings import BackendSettings
from gcache.integrations.sglang.stats import BackendStats
from gcache.integrations.sglang.store import SGLangStore

log = logging.getLogger("gcache.integrations.sglang")

WRITTEN_KEYS_MAX = 65536  # keys clear() can remove: the newest this process stored

T = TypeVar("T")
# SGLang's objects (storage config, host pools, pool transfers, tensors) are untyped here: Any.


class GCacheHiCacheStorage(HiCacheStorage):
    """SGLang's HiCacheStorage over GCache, every interface SGLang calls in one class:
    zero-copy v1 (batch_*_v1), per-pool v2 for hybrid models (batch_*_v2), and the
    legacy flat-page calls (get / set / exists)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.builder = key_builder(storage_config, self.settings.namespace)
        self.stats = BackendStats(bool(storage_config.enable_storage_metrics))
        self._safely = EngineBoundary("GCache backend", log)  # every engine hook: never raises into it
        self.client = connect(self.settings, "GCache backend")
        self.store = SGLangStore(self.client, self.settings.suspect_s, self.stats)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        self._pages: dict[str, PoolPages] = {}  # pool name -> PoolPages (v1 KV under "kv")
        self._logical: set[str] = set()  # pools that own indices but no bytes
        self._flat: PoolKeys | None = None  # v0 keys (one flat page per key)
        self._registered_ptrs: set[int] = set()
        self._written: OrderedDict[bytes, None] = OrderedDict()
        self._written_lock = threading.Lock()
        log.info(
            "GCache HiCache backend: store %s, keys ...%s, interface_v1=%s",
            self.settings.url,
            self.builder.suffix,
            self.settings.interface_v1,
        )

    # -- registration --------------------------------------------------------------

    def _register_memory(self, host_pool: Any) -> None:
        for tensor in pool_tensors(host_pool):
            ptr = tensor.data_ptr()
            if ptr not in self._registered_ptrs:
                self.client.register_buffer(ptr, tensor.numel() * tensor.element_size())
                self._registered_ptrs.add(ptr)

    def _add_pool(self, host_pool: Any, name: object) -> None:
        if is_logical(host_pool):
            self._logical.add(pool_tag(name))
            return
        self._register_memory(host_pool)
        self._pages[pool_tag(name)] = PoolPages(host_pool, name, self.builder)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool(mem_pool_host, "kv")
        if not is_logical(mem_pool_host):
            self._flat = flat_page_keys(
                self.builder, "kv", mem_pool_host.layout, self._pages[AttentionKind.FULL].dtypes
            )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: object) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool is self.mem_pool_host:
            return  # the anchor KV pool, registered by register_mem_pool_host already
        self._add_pool(host_pool, host_pool_name)

    # -- the boundary: nothing raises into SGLang --------------------------------

    def _remember(self, keys: list[bytes]) -> None:
        with self._written_lock:
            for key in keys:
                self._written[key] = None
                self._written.move_to_end(key)
            while len(self._written) > WRITTEN_KEYS_MAX:
                self._written.popitem(last=False)

    # -- moving pages (pointer lists; shared by v1 and v2) --------------------------

    def _read(self, entry_keys: list[bytes], buffers: list[Any], sizes: list[int], per_page: int) -> list[bool]:
        got = self.store.get_into(entry_keys, buffers, sizes)
        return pages_present([g is not None and g == s for g, s in zip(got, sizes)], per_page)

    def _write(self, entry_keys: list[bytes], buffers: list[Any], sizes: list[int] | None, per_page: int) -> list[bool]:
        # Like SGLang's own backends, probe first: a page already stored (a shared
        # prefix) costs one EXISTS entry instead of its bytes on the wire.
        stored = self.store.exists_flags(entry_keys) if self.settings.skip_existing else [False] * len(entry_keys)
        missing = [i for i, ok in enumerate(stored) if not ok]
        self.stats.count("entries_skipped_existing", len(entry_keys) - len(missing))
        if missing:
            keys = [entry_keys[i] for i in missing]
            done = self.store.put_from(
                keys, [buffers[i] for i in missing], None if sizes is None else [sizes[i] for i in missing]
            )
            for i, ok in zip(missing, done):
                stored[i] = ok
            self._remember([k for k, ok in zip(keys, done) if ok])
        return pages_present(stored, per_page)

    def _kv_pages(self) -> PoolPages:
        pages = self._pages.get(AttentionKind.FULL)
        if pages is None:
            raise RuntimeError("no host KV pool registered (register_mem_pool_host not called)")
        return pages

    def _move_v1(self, page_hashes: list[str], host_indices: Any, writing: bool) -> list[bool]:
        if not page_hashes:
            return []
        if AttentionKind.FULL in self._logical:  # no KV bytes on this anchor: v2 pools carry the data
            return [True] * len(page_hashes)
        pages = self._kv_pages()
        entry_keys, ptrs, sizes = pages.locate(page_hashes, host_indices)
        start = time.perf_counter()
        ok = (self._write if writing else self._read)(entry_keys, ptrs, sizes, pages.per_page)
        hit = leading_pages(ok)
        self.stats.count("pages_written" if writing else "pages_read", sum(ok))
        if not writing:
            self.stats.count("pages_missed", len(ok) - sum(ok))
        else:
            self.stats.count("pages_write_failed", len(ok) - sum(ok))
        self.stats.sample("backup" if writing else "prefetch", hit, hit * pages.page_bytes, time.perf_counter() - start)
        return ok

    # -- v1: zero copy ------------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._safely("batch_get_v1", [False] * len(keys), self._move_v1, keys, host_indices, False)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._safely("batch_set_v1", [False] * len(keys), self._move_v1, keys, host_indices, True)

    def _kv_entry_keys(self, page_hashes: list[str]) -> tuple[list[bytes], int]:
        if self.settings.interface_v1:
            pages = self._kv_pages()
            return pages.keys.entries(page_hashes), pages.per_page
        if self._flat is None:
            raise RuntimeError("no host KV pool registered (register_mem_pool_host not called)")
        return self._flat.entries(page_hashes), 1

    def _exists(self, page_hashes: list[str]) -> int:
        if not page_hashes:
            return 0
        if AttentionKind.FULL in self._logical:
            return len(page_hashes)
        entry_keys, per_page = self._kv_entry_keys(page_hashes)
        return self.store.exists_prefix(entry_keys) // per_page

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading pages present: one EXISTS round trip (per owner node in a cluster)."""
        return self._safely("batch_exists", 0, self._exists, keys)

    # -- v2: per pool (hybrid models) ------------------------------------------------
    # A hybrid model (sliding-window attention, Mamba, ...) has a host pool per kind of
    # state: the full-attention KV pool (the anchor) plus e.g. an SWA pool with its own
    # slots. Each pool's pages go under their own keys (the pool word in the key: "swa"),
    # all pools of one call move in one store round trip, and a prefix is reported
    # restorable only when every pool can serve it (prefix.fold).

    def _pool(self, name: object) -> PoolPages | None:
        tag = pool_tag(name)
        if tag in self._logical:
            return None
        pages = self._pages.get(tag)
        if pages is None:
            raise ValueError(f"pool {name!s} was never registered (register_mem_host_pool_v2)")
        return pages

    def _exists_v2(self, keys: list[str], pool_transfers: list[Any] | None) -> PoolTransferResult:
        if not keys:
            return PoolTransferResult(0, {}, [])
        kv_logical = AttentionKind.FULL in self._logical
        kv_keys, kv_per_page = ([], 1) if kv_logical else self._kv_entry_keys(keys)
        asks: list[bytes] = list(kv_keys)
        spans: list[tuple[Any, int, int, PoolPages | None]] = []
        for transfer in pool_transfers or []:
            pages = self._pool(transfer.name)
            entry_keys = pages.keys.entries(keys) if pages is not None else []
            spans.append((transfer, len(asks), len(entry_keys), pages))
            asks.extend(entry_keys)
        flags = self.store.exists_flags(asks) if asks else []  # one round trip for every pool
        kv_pages = len(keys) if kv_logical else leading_pages(pages_present(flags[: len(kv_keys)], kv_per_page))
        pools: list[tuple[object, str, int, list[bool]]] = []
        for transfer, start, count, pages in spans:
            present = (
                [True] * kv_pages
                if pages is None
                else pages_present(flags[start : start + count], pages.per_page)[:kv_pages]
            )
            window = len(transfer.keys) if transfer.keys else 1  # SGLang's trailing-window size
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            pools.append((transfer.name, policy, window, present))
        final, hits, restorable = fold(kv_pages, pools, kv_name=PoolName.KV)
        return PoolTransferResult(final, hits, restorable)

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[Any] | None = None, extra_info: Any = None
    ) -> PoolTransferResult:
        return self._safely("batch_exists_v2", PoolTransferResult.empty(), self._exists_v2, keys, pool_transfers)

    def _move_v2(self, transfers: list[Any], writing: bool) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        spans: list[tuple[Any, int, int, int]] = []
        all_keys: list[bytes] = []
        all_ptrs: list[int] = []
        all_sizes: list[int] = []
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
                results[name] = pages_present(ok[start : start + count], per_page)
        return results

    def _failed_v2(self, transfers: list[Any]) -> dict[Any, list[bool]]:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return self._safely("batch_get_v2", self._failed_v2(transfers), self._move_v2, transfers, False)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return self._safely("batch_set_v2", self._failed_v2(transfers), self._move_v2, transfers, True)

    # -- legacy: one flat page tensor per key -----------------------------------------
    # SGLang's controller uses it for a `dynamic` backend without `interface_v1`: it
    # copies each page into a flat tensor (get_data_page) and back
    # (set_from_flat_data_page). Each flat page is one value, under a "page" key
    # (keys.flat_page_keys); the bytes go from and into the tensors themselves.

    def _flat_key(self, page_hash: str) -> bytes:
        if self._flat is None:
            raise RuntimeError("no host KV pool registered (register_mem_pool_host not called)")
        return self._flat.entries([page_hash])[0]

    def _get_flat(self, keys: list[str], targets: list[Any] | None) -> list[Any]:
        if targets is None:
            targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        views = [tensor_bytes(t, writable=True) for t in targets]
        got = self.store.get_into([self._flat_key(k) for k in keys], views)
        out = [t if g is not None and g == v.nbytes else None for t, v, g in zip(targets, views, got)]
        self.stats.count("pages_read", sum(o is not None for o in out))
        self.stats.count("pages_missed", sum(o is None for o in out))
        return out

    def _set_flat(self, keys: list[str], values: list[Any] | None) -> list[bool]:
        if values is None or len(values) != len(keys):
            raise ValueError("the legacy set needs one tensor per key")
        views = [tensor_bytes(v, writable=False) for v in values]
        ok = self._write([self._flat_key(k) for k in keys], views, None, 1)
        self.stats.count("pages_written", sum(ok))
        self.stats.count("pages_write_failed", len(ok) - sum(ok))
        return ok

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        targets = None if target_location is None else [target_location]
        return self._safely("get", [None], self._get_flat, [key], targets)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        return self._safely("batch_get", [None] * len(keys), self._get_flat, keys, target_locations)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._safely("set", [False], self._set_flat, [key], [value])[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return all(self._safely("batch_set", [False], self._set_flat, keys, values))

    def exists(self, key: str) -> bool:
        return self._safely("exists", 0, self._exists, [key]) == 1

    # -- lifecycle --------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (samples only when SGLang runs with --enable-metrics), drained."""
        return self.stats.drain_metrics()

    def counters(self) -> dict[str, int]:
        """GCache's own counts (pages read / missed / written, store errors, ...)."""
        return self.stats.snapshot()

    def clear(self) -> bool:
        """Removes the pages this process stored (the newest WRITTEN_KEYS_MAX entries).

        GCache is shared by other models, tenants and ranks and has no prefix delete,
        so pages stored by earlier processes stay until the store evicts them.
        """
        with self._written_lock:
            keys = list(self._written)
        if keys and not self.store.remove(keys):
            return False
        with self._written_lock:
            for key in keys:
                self._written.pop(key, None)
        return True

    def close(self) -> None:
        self.client.close()
