"""Engine counters and a TTFT histogram, rendered as Prometheus text (no dependency).

Written only by the engine thread; read by HTTP handler threads under the same lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from gcache.worker.integrity import require

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "gcache_worker_"


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # one per bound, plus +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        require(list(self.bounds) == sorted(self.bounds), "bucket bounds must be increasing")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.n += 1


# Cache-hierarchy figures (TieredPrefixCache.stats()); everything not listed as a gauge is a counter.
CACHE_GAUGES = {
    "l2_full_pages_used",
    "l2_swa_pages_used",
    "l2_full_pages_total",
    "l2_swa_pages_total",
    "l2_pinned_pages",
    "l3_write_queue_depth",
}
CACHE_HELP = {
    "l2_load_pages": "pages loaded host -> device (L2 hits)",
    "l2_load_bytes": "bytes loaded host -> device",
    "l2_load_seconds": "seconds the host -> device copies took",
    "l2_load_wait_seconds": "seconds the forward waited for layers still loading",
    "l2_write_pages": "full pages written device -> host",
    "l2_write_bytes": "bytes written device -> host (full + SWA)",
    "l2_write_dropped": "pages not written to host memory: it was full of pinned pages",
    "loads_cut_to_fit": "host -> device loads cut to what the device pools could hold",
    "l3_writes_skipped_down": "L3 writes skipped while GCache was marked down",
    "l2_evicted_pages": "host pages evicted",
    "l3_writes_queued": "L3 write jobs queued",
    "l3_writes_dropped": "L3 write jobs dropped (queue full or store down)",
    "l3_write_pages": "pages written to GCache",
    "l3_write_bytes": "bytes written to GCache",
    "l3_write_errors": "L3 write jobs that failed",
    "l3_write_seconds": "seconds spent writing to GCache",
    "l3_prefetches": "L3 prefetches started",
    "l3_prefetch_hit": "L3 prefetches that found pages",
    "l3_prefetch_miss": "L3 prefetches that found nothing usable",
    "l3_prefetch_failed": "L3 prefetches that failed",
    "l3_prefetch_dropped": "L3 prefetches not started (queue full)",
    "l3_prefetch_cancelled": "L3 prefetches whose request was admitted or dropped before they completed",
    "l3_read_pages": "pages read from GCache",
    "l3_read_bytes": "bytes read from GCache",
    "l3_read_seconds": "seconds spent reading from GCache",
    "l3_read_bad_pages": "pages GCache did not return whole (missing or failed checksum): the chain ends there",
    "l3_touch_probes": "prefix probes that keep hot chains warm on the node",
    "l3_blob_writes_queued": "L3 blob writes queued (MTP tails, on the page writers' queue)",
    "l3_blob_writes_dropped": "L3 blob writes dropped (queue full or store down; the tail stays in L1/L2)",
    "l3_blob_write_errors": "L3 blob writes that failed",
    "l3_blob_write_bytes": "bytes of blobs (MTP tails) written to GCache",
}


class EngineMetrics:
    """Counters (monotonic) and gauges (set each step) of one engine."""

    COUNTERS = {
        "requests_total": "requests finished (any reason)",
        "requests_rejected_total": "requests refused at submission (bad input or full queue)",
        "prompt_tokens_total": "prompt tokens of finished requests",
        "generation_tokens_total": "tokens generated",
        "cached_prompt_tokens_total": "prompt tokens served from the prefix cache",
        "cached_tokens_l1_total": "prompt tokens served from device memory (L1)",
        "cached_tokens_l2_total": "prompt tokens loaded from host memory (L2)",
        "cached_tokens_l3_total": "prompt tokens read from GCache (L3) via host memory",
        "prefill_tokens_computed_total": "tokens run through the model as prefill",
        "preemptions_total": "running requests sent back to the waiting queue",
        "steps_total": "engine steps that ran the model",
        "mtp_rebuilt_tokens_total": "positions of cached prefixes whose MTP KV was rebuilt at admission",
        "mtp_tail_hits_l1_total": "cached prefixes whose MTP tail came from L1 (the mtp pool)",
        "mtp_tail_hits_l2_total": "cached prefixes whose MTP tail came from L2 (the mtp pool)",
        "mtp_tail_hits_l3_total": "cached prefixes whose MTP tail came from L3 (the mtp pool)",
        "mtp_tail_misses_total": "cached prefixes without a usable MTP tail (rebuilt instead)",
        "mtp_tail_writes_total": "MTP checkpoint tails written to the mtp pool",
        **{
            f"spec_{what}_out_{b}_total": f"{text}, output positions {b.replace('_', '-')}"
            for b in ("0_128", "128_256", "256_512", "512_inf")
            for what, text in (
                ("drafted", "MTP draft tokens proposed"),
                ("accepted", "MTP draft tokens the main model accepted"),
                ("forwards", "decode forwards of a request (tokens per forward = emitted / forwards)"),
                ("emitted", "tokens decode forwards emitted"),
            )
        },
    }
    GAUGES = {
        "waiting_requests": "requests in the waiting queue",
        "running_requests": "requests holding KV pages",
        "full_pool_pages_used": "full-attention KV pages in use",
        "full_pool_pages_total": "full-attention KV pages in the pool",
        "swa_pool_pages_used": "SWA KV pages in use",
        "swa_pool_pages_total": "SWA KV pages in the pool",
        "tree_full_pages": "full pages owned by the prefix tree",
        "tree_swa_pages": "SWA pages owned by the prefix tree",
    }

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters = {k: 0 for k in self.COUNTERS}
        self.gauges = {k: 0 for k in self.GAUGES}
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.cache: dict[str, Any] = {}

    def inc(self, name: str, by: int = 1) -> None:
        with self.lock:
            self.counters[name] += by

    def set_gauges(self, **values: int) -> None:
        with self.lock:
            for k, v in values.items():
                require(k in self.gauges, f"unknown gauge {k!r}")
                self.gauges[k] = v

    def set_cache_stats(self, stats: dict[str, Any]) -> None:
        with self.lock:
            self.cache = dict(stats)

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                **self.counters,
                **self.gauges,
                **self.cache,
                "ttft_count": self.ttft.n,
                "ttft_sum_s": self.ttft.total,
            }

    def render(self) -> str:
        lines: list[str] = []
        with self.lock:
            for k, help_ in self.COUNTERS.items():
                lines += [
                    f"# HELP {PREFIX}{k} {help_}",
                    f"# TYPE {PREFIX}{k} counter",
                    f"{PREFIX}{k} {self.counters[k]}",
                ]
            for k, help_ in self.GAUGES.items():
                lines += [f"# HELP {PREFIX}{k} {help_}", f"# TYPE {PREFIX}{k} gauge", f"{PREFIX}{k} {self.gauges[k]}"]
            for k, v in sorted(self.cache.items()):
                kind = "gauge" if k in CACHE_GAUGES else "counter"
                lines += [
                    f"# HELP {PREFIX}{k} {CACHE_HELP.get(k, k.replace('_', ' '))}",
                    f"# TYPE {PREFIX}{k} {kind}",
                    f"{PREFIX}{k} {v}",
                ]
            name = PREFIX + "ttft_seconds"
            lines += [f"# HELP {name} time from arrival to first generated token", f"# TYPE {name} histogram"]
            cum = 0
            for b, c in zip(self.ttft.bounds, self.ttft.counts):
                cum += c
                lines.append(f'{name}_bucket{{le="{b}"}} {cum}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {self.ttft.n}')
            lines += [f"{name}_sum {self.ttft.total:.6f}", f"{name}_count {self.ttft.n}"]
        return "\n".join(lines) + "\n"
