"""SGLang's legacy storage interface (get / set / exists, one flat page tensor per key).

SGLang's controller uses it for a `dynamic` backend without `interface_v1`: it
copies each page into a flat tensor (get_data_page) and back
(set_from_flat_data_page). Each flat page is one value, under a "page" key
(sglang_keys.flat_page_keys); the bytes go from and into the tensors themselves.
"""
from __future__ import annotations

from gcache.integrations.sglang.pools import tensor_bytes


class LegacyCalls:
    """Mixed into GCacheHiCacheStorage: uses its _flat, store, stats, _write, _safely."""

    def _flat_key(self, page_hash) -> bytes:
        if self._flat is None:
            raise RuntimeError("no host KV pool registered (register_mem_pool_host not called)")
        return self._flat.entries([page_hash])[0]

    def _get_flat(self, keys, targets) -> list:
        if targets is None:
            targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        views = [tensor_bytes(t, writable=True) for t in targets]
        got = self.store.get_into([self._flat_key(k) for k in keys], views)
        out = [t if g is not None and g == v.nbytes else None for t, v, g in zip(targets, views, got)]
        self.stats.count("pages_read", sum(o is not None for o in out))
        self.stats.count("pages_missed", sum(o is None for o in out))
        return out

    def _set_flat(self, keys, values) -> list[bool]:
        if values is None or len(values) != len(keys):
            raise ValueError("the legacy set needs one tensor per key")
        views = [tensor_bytes(v, writable=False) for v in values]
        ok = self._write([self._flat_key(k) for k in keys], views, None, 1)
        self.stats.count("pages_written", sum(ok))
        self.stats.count("pages_write_failed", len(ok) - sum(ok))
        return ok

    def get(self, key, target_location=None, target_sizes=None):
        targets = None if target_location is None else [target_location]
        return self._safely("get", [None], self._get_flat, [key], targets)[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return self._safely("batch_get", [None] * len(keys), self._get_flat, keys, target_locations)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self._safely("set", [False], self._set_flat, [key], [value])[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return all(self._safely("batch_set", [False], self._set_flat, keys, values))

    def exists(self, key) -> bool:
        return self._safely("exists", 0, self._exists, [key]) == 1

