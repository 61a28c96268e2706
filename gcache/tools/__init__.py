"""Tooling around the store: the `gcache-bench` harness (storebench), local clusters and every
process launcher (devcluster), and `gcache-demo` (demo), which drives both."""
