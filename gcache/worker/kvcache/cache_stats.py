"""The tiered cache's counters and gauges for /metrics (TieredPrefixCache.stats): what it
counts itself (loads, writes, cuts, skips) and what it reads of its tiers (L2 occupancy, the
L3 store's counters and write queue)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gcache.common.attention import AttentionKind

if TYPE_CHECKING:
    from gcache.worker.kvcache.tiers.host_cache import HostCache
    from gcache.worker.kvcache.tiers.l3_store import L3Store

STAT_NAMES = (
    "l2_load_pages",
    "l2_load_bytes",
    "l2_load_seconds",
    "l2_load_wait_seconds",
    "l2_write_pages",
    "l2_write_bytes",
    "l2_write_dropped",
    "loads_cut_to_fit",
    "l3_writes_skipped_down",
)


class CacheStats:
    """Counters of the engine thread (no lock: only it adds) and the report over the tiers."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = dict.fromkeys(STAT_NAMES, 0)

    def add(self, name: str, by: float = 1) -> None:
        self.counters[name] += by

    def report(self, host: HostCache | None, l3: L3Store | None) -> dict:
        """The counters, L2's occupancy and L3's counters (names without prefix)."""
        out = dict(self.counters)
        if host is not None:
            f, s = host.used_pages()
            out.update(
                l2_full_pages_used=f,
                l2_swa_pages_used=s,
                l2_full_pages_total=host.pool.pools[AttentionKind.FULL].num_pages,
                l2_swa_pages_total=host.pool.pools[AttentionKind.SWA].num_pages,
                l2_pinned_pages=host.pinned_pages(),
                l2_evicted_pages=host.stats["evicted_full"],
            )
        if l3 is not None:
            out.update({f"l3_{k}": v for k, v in l3.stats_snapshot().items()})
            out["l3_write_queue_depth"] = l3.write_queue_depth()
        return out
