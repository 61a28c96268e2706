"""The backend's calls to GCache: the adapters' GuardedStore (a failure of the store is a
miss, never an exception on SGLang's prefetch and backup threads), counting exists calls."""

from __future__ import annotations

import logging

from gcache.client.api import Client
from gcache.integrations.common.guarded_store import Counts, GuardedStore

log = logging.getLogger("gcache.integrations.sglang")


class SGLangStore(GuardedStore):
    """GuardedStore that counts existence probes (the backend's `exists_calls` counter)."""

    def __init__(self, client: Client, suspect_s: float, stats: Counts) -> None:
        super().__init__(client, suspect_s, stats, log)

    def exists_prefix(self, keys: list[bytes]) -> int:
        self.stats.count("exists_calls")
        return super().exists_prefix(keys)

    def exists_flags(self, keys: list[bytes]) -> list[bool]:
        self.stats.count("exists_calls")
        return super().exists_flags(keys)
