"""Settings of the cache hierarchy (L1 device / L2 host / L3 GCache), SGLang's names."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

from gcache.common.flags import flag


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


MIB = 1 << 20
HIERARCHY = "cache hierarchy (L1 device / L2 host / L3 GCache)"  # gcache-worker's flag group


@dataclass(frozen=True)
class TieredCacheConfig:
    # Flags of gcache-worker are marked (gcache.common.flags), in the group HIERARCHY.
    l2_bytes: int = field(  # host pool size; 0 = no L2 (and so no L3)
        default=0,
        metadata=flag(
            "host-memory KV pool (L2), MiB; pages evicted from the device go here (0 = no L2)",
            name="--l2-mib",
            dest="l2_mib",
            type=float,
            group=HIERARCHY,
            from_field=lambda n: n / MIB,
            to_field=lambda mib: int(mib * MIB),
        ),
    )
    l2_swa_full_ratio: float = field(  # SWA slots per full slot in L2 (checkpoint tails only)
        default=0.25,
        metadata=flag("SWA slots per full slot in L2 (L2 keeps SWA only at checkpoints)", group=HIERARCHY),
    )
    l3_url: str = field(  # "host:port" or "gcache://m1:p,..."; "" = no L3
        default="",
        metadata=flag(
            "GCache as L3: host:port of one gcache-server or gcache://m1:p,... for a cluster "
            "(needs --l2-mib); pages are keyed by --model-name, so workers of one model share them",
            name="--l3",
            dest="l3",
            metavar="URL",
            group=HIERARCHY,
        ),
    )
    model_name: str = "gcache-hybrid"  # L3 key suffix: another model never reads these pages
    write_policy: str = field(  # a WritePolicy (or its string)
        default=WritePolicy.WRITE_THROUGH,
        metadata=flag(
            "write_through: cached pages go to L2/L3 at once; write_through_selective: once hit "
            "--write-threshold times; write_back: when evicted from the device",
            choices=WRITE_POLICIES,
            group=HIERARCHY,
            from_field=str,
        ),
    )
    write_threshold: int = field(  # write_through_selective: hits before a page is written
        default=2, metadata=flag("hits before write_through_selective writes a page", group=HIERARCHY)
    )
    prefetch_policy: str = field(  # a PrefetchPolicy (or its string)
        default=PrefetchPolicy.TIMEOUT,
        metadata=flag(
            "a queued request prefetches from L3 while it waits; best_effort: admit it whenever "
            "it is its turn; wait_complete: not before the prefetch is done; timeout: wait at "
            "most --prefetch-timeout-s (default: wait_complete with --role decode, else timeout)",
            choices=PREFETCH_POLICIES,
            group=HIERARCHY,
            default=None,  # by --role (gcache.worker.http.pd_flags.check_role)
        ),
    )
    prefetch_timeout_s: float = field(  # the timeout policy's wait for an L3 prefetch
        default=0.5, metadata=flag(group=HIERARCHY)
    )
    prefetches_per_step: int = 8  # new L3 prefetches started per engine step
    swa_checkpoint_pages: int = field(  # keep SWA for the window before every C pages (0 = ends only)
        default=0,
        metadata=flag(
            "also keep SWA KV for the window before every N pages (0: only at request ends "
            "and branch points); more checkpoints = more resumable points, more SWA bytes",
            group=HIERARCHY,
        ),
    )
    swa_checkpoint_ends: bool = True  # checkpoint every request end and branch point (failure
    #                                   mode 4 fix: short chats keep their SWA in every tier)
    mtp_tail_bytes: int = 32 << 20  # the `mtp` pool (MTP window tails of checkpoints) per tier, L1 and L2
    swa_keep_spare: bool = True  # first-reuse fix: out-of-window SWA no checkpoint needs stays
    #                              (request, then tree) until the pool needs it, evicted first
    layerwise_load: bool = field(  # layer i computes while layer i+1 is loading
        default=True,
        metadata=flag(
            "load host KV for all layers before computing (default: layer by layer, overlapped)",
            name="--no-layerwise-load",
            dest="no_layerwise_load",
            action="store_true",
            group=HIERARCHY,
            to_field=operator.not_,
        ),
    )
    chunk_loads: bool = True  # load what fits of an L2 hit (failure mode 2 fix), not all-or-nothing
    load_throttle_bytes_per_s: float = 0.0  # benches: host -> device copies at most this fast (0 = memcpy)
    l3_timeout_s: float = field(
        default=2.0,
        metadata=flag("longest wait on GCache per call; after a failure L3 is skipped for a while", group=HIERARCHY),
    )
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
