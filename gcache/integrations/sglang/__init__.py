"""GCache as SGLang's HiCache L3 storage backend: load it with SGLang's `dynamic` backend,
`module_path` `gcache.integrations.sglang`, `class_name` `GCacheHiCacheStorage`.

backend (the HiCacheStorage class), settings (extra_config and the connection), keys and pools
(page keys per KV pool), prefix (prefix checks), store (store failures become misses), stats,
testing (helpers for the tests and benches, not used by the backend itself).
"""

__all__ = ["GCacheHiCacheStorage"]


def __getattr__(name: str) -> type:
    # Lazy: the backend imports sglang (and torch); keys, prefix and settings do not, so
    # they stay importable (and testable) without SGLang installed.
    if name == "GCacheHiCacheStorage":
        from gcache.integrations.sglang.backend import GCacheHiCacheStorage

        return GCacheHiCacheStorage
    raise AttributeError(f"module 'gcache.integrations.sglang' has no attribute {name!r}")
