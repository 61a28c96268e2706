"""GCache's benchmark scripts, by family; each runs as `python -m bench.<family>.<name>` from the
repository root (bench/README.md lists them). The store's own throughput harness is
`gcache-bench` (gcache.tools.storebench), not this package."""
