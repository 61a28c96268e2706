"""The cache manager of `--no-prefix-cache`: nothing is shared, nothing is kept."""

from __future__ import annotations

from gcache.common.attention import AttentionKind
from gcache.worker.integrity import require
from gcache.worker.kvcache.cache_manager import CacheManager, MatchResult, NoLoads
from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV


class NoPrefixCache(CacheManager):
    def __init__(self, kv: DualKVCache) -> None:
        self.kv = kv

    def match(self, req) -> MatchResult:
        return MatchResult()

    def ready(self, req) -> bool:
        return True

    def poll(self, waiting) -> None:
        return None

    def prepare_load(self, req) -> MatchResult:
        req.kv = RequestKV(self.kv.page_size, self.kv.window)
        return MatchResult()

    def start_loads(self):
        return NoLoads()

    def prepare_write(self, req, final: bool) -> None:
        return None

    def lock(self, node) -> None:
        return None

    def unlock(self, node) -> None:
        return None

    def release(self, req) -> None:
        req.kv.release(self.kv)
        req.kv, req.lock_node = None, None

    def evict(self, full_pages: int, swa_pages: int) -> tuple[int, int]:
        return 0, 0

    def trim_swa(self, req, pressure: bool = False) -> int:
        """Nothing is cached, so SWA is O(W) from the first chunk on."""
        return req.kv.free_swa_out_of_window(self.kv)

    def estimate_uncached(self, req) -> int:
        return req.num_tokens

    def check_integrity(self, running, waiting=()) -> None:
        for kind, pool, owned in (
            (AttentionKind.FULL, self.kv.full, [p for r in running for p in r.kv.full_pages]),
            (AttentionKind.SWA, self.kv.swa, [p for r in running for p in r.kv.swa_pages if p is not None]),
        ):
            require(len(owned) == len(set(owned)), f"a {kind} page is owned by two requests")
            require(pool.num_used == len(owned), f"{kind} pages: {pool.num_used} used, requests own {len(owned)}")
