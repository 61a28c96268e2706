"""Leaf helpers every layer may use and that use nothing of ours but gcache.errors: sizes and
durations (units), host:port parsing (address), the failure breaker (breaker), child processes
(processes)."""
