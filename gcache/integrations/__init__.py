"""Adapters that let inference engines use GCache as their KV-cache store.

`gcache.integrations.sglang.GCacheHiCacheStorage` is SGLang's HiCache L3 backend
(loaded by SGLang's `dynamic` storage backend). Nothing here is imported by
`import gcache`: each adapter imports its engine (and torch) only when loaded.
"""
