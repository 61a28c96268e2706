"""What every engine adapter shares: the store guard that never raises into an engine, and the
reader of an engine's `gcache_*` extra-config keys. Imports no engine (and no torch)."""
