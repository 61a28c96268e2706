"""`gcache-bench --plot FILE.png`: each measure per transport beside its peers and
the machine's limits, bars at the median with the min..max spread of the repeats."""

from __future__ import annotations

from gcache.tools.plotting import charts
from gcache.tools.storebench.report import MEASURES, measure_spread

# measure -> the machine limits drawn beside it (report["limits"] fields)
_LIMITS = {
    "put_gbps": (
        ("memcpy into an arena", "memcpy_put_gbps"),
        ("loopback TCP into an arena", "loopback_tcp_put_gbps"),
    ),
    "get_gbps": (
        ("memcpy out of an arena", "memcpy_batch_gbps"),
        ("loopback TCP out of an arena", "loopback_tcp_get_gbps"),
    ),
}


def bars_for(report: dict, measure: str) -> list[tuple[str, list[float] | None]]:
    """(label, [min, median, max]) for every GCache transport and available peer."""
    bars = []
    by_transport = report.get("transports", {}).get("by_transport")
    if by_transport:
        for name, t in by_transport.items():
            if t.get("available"):
                bars.append((f"gcache {name}", t["spread"].get(measure)))
    else:
        peer = report["peers"].get("gcache", {})
        if peer.get("available"):
            bars.append(("gcache", measure_spread(peer["workloads"]).get(measure)))
    for name, peer in report["peers"].items():
        if name != "gcache" and peer.get("available"):
            bars.append((name, measure_spread(peer["workloads"]).get(measure)))
    return bars


def plot_report(report: dict, path: str) -> None:
    plt = charts.pyplot()
    panels = []
    for key, _workload, _field, label, scale, unit, _higher in MEASURES:
        bars = [(name, [v * scale for v in spread] if spread else None) for name, spread in bars_for(report, key)]
        if any(spread for _, spread in bars):
            panels.append((key, label, unit, bars))
    if not panels:
        raise SystemExit("--plot: the report has no measures to draw")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    cfg = report["config"]
    limits = report["limits"]
    for ax, (key, label, unit, bars) in zip(axes[0], panels):
        lines = [(name, limits.get(field)) for name, field in _LIMITS.get(key, ())]
        charts.bar_panel(ax, label, unit, bars, lines)
    fig.suptitle(
        f"gcache-bench: {cfg['batch']} x {cfg['value_size'] >> 10} KiB, {cfg['workers']} {cfg['mode']}, "
        f"median and min..max of {cfg['repeat']} interleaved rounds",
        fontsize=10,
    )
    charts.save(fig, path)
