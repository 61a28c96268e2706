"""Engine counters and a TTFT histogram, rendered as Prometheus text (no dependency).

Written only by the engine thread; read by HTTP handler threads under the same lock.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "gcache_worker_"


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # one per bound, plus +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        assert list(self.bounds) == sorted(self.bounds), "bucket bounds must be increasing"
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.n += 1


class EngineMetrics:
    """Counters (monotonic) and gauges (set each step) of one engine."""

    COUNTERS = {
        "requests_total": "requests finished (any reason)",
        "requests_rejected_total": "requests refused at submission (bad input or full queue)",
        "prompt_tokens_total": "prompt tokens of finished requests",
        "generation_tokens_total": "tokens generated",
        "cached_prompt_tokens_total": "prompt tokens served from the prefix cache",
        "prefill_tokens_computed_total": "tokens run through the model as prefill",
        "preemptions_total": "running requests sent back to the waiting queue",
        "steps_total": "engine steps that ran the model",
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

    def inc(self, name: str, by: int = 1) -> None:
        with self.lock:
            self.counters[name] += by

    def set_gauges(self, **values: int) -> None:
        with self.lock:
            for k, v in values.items():
                assert k in self.gauges, k
                self.gauges[k] = v

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def snapshot(self) -> dict:
        with self.lock:
            return {**self.counters, **self.gauges, "ttft_count": self.ttft.n, "ttft_sum_s": self.ttft.total}

    def render(self) -> str:
        lines: list[str] = []
        with self.lock:
            for k, help_ in self.COUNTERS.items():
                lines += [f"# HELP {PREFIX}{k} {help_}", f"# TYPE {PREFIX}{k} counter",
                          f"{PREFIX}{k} {self.counters[k]}"]
            for k, help_ in self.GAUGES.items():
                lines += [f"# HELP {PREFIX}{k} {help_}", f"# TYPE {PREFIX}{k} gauge",
                          f"{PREFIX}{k} {self.gauges[k]}"]
            name = PREFIX + "ttft_seconds"
            lines += [f"# HELP {name} time from arrival to first generated token",
                      f"# TYPE {name} histogram"]
            cum = 0
            for b, c in zip(self.ttft.bounds, self.ttft.counts):
                cum += c
                lines.append(f'{name}_bucket{{le="{b}"}} {cum}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {self.ttft.n}')
            lines += [f"{name}_sum {self.ttft.total:.6f}", f"{name}_count {self.ttft.n}"]
        return "\n".join(lines) + "\n"
