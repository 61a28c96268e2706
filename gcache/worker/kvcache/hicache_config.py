"""Settings of the cache hierarchy (L1 device / L2 host / L3 GCache), SGLang's names."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WritePolicy(enum.StrEnum):
    """When computed pages go down to L2 (and from there to L3): SGLang's names."""

    WRITE_THROUGH = "write_through"  # every new page, at insert
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # a page once it has had write_threshold hits
    WRITE_BACK = "write_back"  # a page when L1 evicts it


class PrefetchPolicy(enum.StrEnum):
    """How long a waiting request whose L3 prefetch runs is held back: SGLang's names."""

    BEST_EFFORT = "best_effort"  # never: admit it with what has arrived
    WAIT_COMPLETE = "wait_complete"  # until the prefetch is done (the client's timeouts bound it)
    TIMEOUT = "timeout"  # until done or prefetch_timeout_s passed


WRITE_POLICIES = tuple(p.value for p in WritePolicy)
PREFETCH_POLICIES = tuple(p.value for p in PrefetchPolicy)


@dataclass(frozen=True)
class HiCacheConfig:
    l2_bytes: int = 0  # host pool size; 0 = no L2 (and so no L3)
    l2_swa_full_ratio: float = 0.25  # SWA slots per full slot in L2 (checkpoint tails only)
    l3_url: str = ""  # "host:port" or "gcache://m1:p,..."; "" = no L3
    model_name: str = "gcache-hybrid"  # L3 key suffix: another model never reads these pages
    write_policy: str = WritePolicy.WRITE_THROUGH  # a WritePolicy (or its string)
    write_threshold: int = 2  # write_through_selective: hits before a page is written
    prefetch_policy: str = PrefetchPolicy.TIMEOUT  # a PrefetchPolicy (or its string)
    prefetch_timeout_s: float = 0.5  # the timeout policy's wait for an L3 prefetch
    prefetches_per_step: int = 8  # new L3 prefetches started per engine step
    swa_checkpoint_pages: int = 0  # keep SWA for the window before every C pages (0 = ends only)
    swa_checkpoint_ends: bool = True  # checkpoint every request end and branch point (failure
    #                                   mode 4 fix: short chats keep their SWA in every tier)
    mtp_tail_bytes: int = 32 << 20  # the `mtp` pool (MTP window tails of checkpoints) per tier, L1 and L2
    swa_keep_spare: bool = True  # first-reuse fix: out-of-window SWA no checkpoint needs stays
    #                              (request, then tree) until the pool needs it, evicted first
    layerwise_load: bool = True  # layer i computes while layer i+1 is loading
    chunk_loads: bool = True  # load what fits of an L2 hit (failure mode 2 fix), not all-or-nothing
    load_throttle_bytes_per_s: float = 0.0  # benches: host -> device copies at most this fast (0 = memcpy)
    l3_timeout_s: float = 2.0
    l3_write_queue_max: int = 256
    l3_protect_prefix: bool = True  # failure mode 3 fix (suffix-first writes, prefix probes)
    hit_counts_max: int = 1 << 20  # pages whose hit count write_through_selective remembers

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy must be one of {PREFETCH_POLICIES}, got {self.prefetch_policy!r}")
        if self.l2_bytes < 0:
            raise ValueError("l2_bytes must be >= 0")
        if self.l3_url and not self.l2_bytes:
            raise ValueError("an L3 needs an L2 (--l2-mib > 0): L3 pages are read into host pages")
        if not 1 <= self.write_threshold <= 1_000_000:
            raise ValueError("write_threshold must be in [1, 1000000]")
        if not 0 < self.prefetch_timeout_s <= 600:
            raise ValueError("prefetch_timeout_s must be in (0, 600]")
        if self.mtp_tail_bytes < 0:
            raise ValueError("mtp_tail_bytes must be >= 0")
        if self.swa_checkpoint_pages < 0:
            raise ValueError("swa_checkpoint_pages must be >= 0")
        if not 0 < self.l2_swa_full_ratio <= 64:
            raise ValueError("l2_swa_full_ratio must be in (0, 64]")
        if not 1 <= self.prefetches_per_step <= 1024 or not 1 <= self.hit_counts_max:
            raise ValueError("prefetches_per_step must be in [1, 1024], hit_counts_max >= 1")
