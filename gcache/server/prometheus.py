"""Renders a node's stats() dict in the Prometheus text exposition format."""

from __future__ import annotations

HISTOGRAM_BUCKETS = 32  # bucket i: [2^i, 2^(i+1)) microseconds; the last one is open-ended


def render(stats: dict, prefix: str = "gcache") -> str:
    """stats: {"counters": {name: int}, "gauges": {name: int}, "histograms": {name: [counts]},
    "histogram_sums_us": {name: int}}.

    Counters become `<prefix>_<name>_total`, gauges `<prefix>_<name>`, latency
    histograms `<prefix>_<name>_latency_seconds` with cumulative `_bucket{le=...}`
    lines (upper bounds 2^(i+1) us, then +Inf), `_sum` (seconds, from
    histogram_sums_us; 0 if a node does not report it) and `_count`.
    """
    lines: list[str] = []
    for name, value in sorted(stats.get("counters", {}).items()):
        metric = f"{prefix}_{name}_total"
        lines.append(f"# TYPE {metric} counter")
        lines.append(f"{metric} {int(value)}")
    for name, value in sorted(stats.get("gauges", {}).items()):
        metric = f"{prefix}_{name}"
        lines.append(f"# TYPE {metric} gauge")
        lines.append(f"{metric} {int(value)}")
    _render_tenants(stats.get("tenants", {}), prefix, lines)
    sums_us = stats.get("histogram_sums_us", {})
    for name, buckets in sorted(stats.get("histograms", {}).items()):
        metric = f"{prefix}_{name}_latency_seconds"
        lines.append(f"# TYPE {metric} histogram")
        cumulative = 0
        for i, count in enumerate(buckets[:-1]):
            cumulative += int(count)
            upper_s = (1 << (i + 1)) / 1e6
            lines.append(f'{metric}_bucket{{le="{upper_s:.6g}"}} {cumulative}')
        cumulative += int(buckets[-1]) if buckets else 0
        lines.append(f'{metric}_bucket{{le="+Inf"}} {cumulative}')
        # Fixed-point seconds: exact to the microsecond, never exponent notation.
        lines.append(f"{metric}_sum {int(sums_us.get(name, 0)) / 1e6:.6f}")
        lines.append(f"{metric}_count {cumulative}")
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _render_tenants(tenants: dict, prefix: str, lines: list[str]) -> None:
    """Per-tenant usage and quotas (auth on): `<prefix>_tenant_<field>{tenant="name"}`,
    e.g. gcache_tenant_memory_bytes{tenant="alice"}. Tenant names only, never keys."""
    fields = sorted({field for values in tenants.values() for field in values})
    for field in fields:
        metric = f"{prefix}_tenant_{field}"
        lines.append(f"# TYPE {metric} gauge")
        for name, values in sorted(tenants.items()):
            lines.append(f'{metric}{{tenant="{_label(name)}"}} {int(values.get(field, 0))}')
