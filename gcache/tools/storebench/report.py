"""Turns measurements into ratios, target verdicts, a text table and the JSON object."""

from __future__ import annotations

import statistics

from gcache.common.units import format_size

# (key, workload, field, label, scale, unit, higher_is_better)
MEASURES = (
    ("put_gbps", "put", "gbps", "PUT from a caller's buffer", 1.0, "GB/s", True),
    ("get_gbps", "get", "gbps", "GET into a caller's buffer", 1.0, "GB/s", True),
    ("exists_p50_us", "exists", "p50_us", "batch_is_exist p50", 1e-3, "ms", False),
    ("exists_p99_us", "exists", "p99_us", "batch_is_exist p99", 1e-3, "ms", False),
    ("latency_p50_us", "latency", "p50_us", "single GET p50", 1.0, "us", False),
    ("latency_p99_us", "latency", "p99_us", "single GET p99", 1.0, "us", False),
)

# (measure, against, comparison, bound): the targets, ratio = gcache / against
TARGETS = (
    ("get_gbps", "loopback_tcp", ">=", 0.6),
    ("get_gbps", "mooncake", ">=", 2.0),
    ("get_gbps", "redis", ">=", 3.0),
    ("put_gbps", "mooncake", ">=", 1.5),
    ("put_gbps", "redis", ">=", 2.0),
    ("exists_p99_us", "mooncake", "<", 1.0),
    ("exists_p99_us", "redis", "<", 0.2),
    ("latency_p50_us", "redis", "<=", 0.7),
)


# Per transport (transport, measure, against, comparison, bound): ratio = measure / against,
# except against "us", where the bound is the measure itself in microseconds.
TRANSPORT_TARGETS = (
    ("shm", "get_gbps", "memcpy_batch", ">=", 0.8),
    ("shm", "put_gbps", "memcpy_batch", ">=", 0.6),
    ("shm", "latency_p50_us", "us", "<=", 15.0),
    ("shm", "latency_p50_us", "python_tcp_pingpong", "<", 1.0),
    ("tcp", "put_gbps", "loopback_tcp_batch", ">=", 0.85),
    ("tcp", "get_gbps", "loopback_tcp_batch", ">=", 0.85),
)
_LIMIT_FIELDS = {
    "memcpy_batch": "memcpy_batch_gbps",
    "loopback_tcp_batch": "loopback_tcp_batch_gbps",
    "python_tcp_pingpong": "python_tcp_pingpong_p50_us",
}
_COMPARE = {">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}


def measure_values(workloads: dict) -> dict:
    """{measure key: value} for the workloads a peer ran."""
    out = {}
    for key, workload, field, *_ in MEASURES:
        if workload in workloads:
            out[key] = workloads[workload][field]
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def measure_spread(workloads: dict) -> dict:
    """{measure key: [min, median, max]} over the repeats of each workload."""
    out = {}
    for key, workload, field, *_ in MEASURES:
        runs = workloads.get(workload, {}).get("runs")
        if runs:
            values = sorted(r[field] for r in runs)
            out[key] = [values[0], statistics.median(values), values[-1]]
    return out


def build_transports(transports: dict, limits: dict, peer_values: dict) -> dict:
    """Each transport's medians, spreads, ratios to the peers, and its targets."""
    out = {}
    for name, t in transports.items():
        if not t.get("available"):
            out[name] = {"available": False, "reason": t.get("reason")}
            continue
        values = measure_values(t["workloads"])
        ratios = {
            peer: {k: _ratio(values.get(k), v) for k, v in theirs.items()}
            for peer, theirs in peer_values.items()
            if peer != "gcache"
        }
        out[name] = {"available": True, "measures": values, "spread": measure_spread(t["workloads"]), "ratios": ratios}
    targets = []
    for transport, measure, against, op, bound in TRANSPORT_TARGETS:
        if transport not in transports:
            continue
        value = out[transport].get("measures", {}).get(measure)
        ratio = value if against == "us" else _ratio(value, limits.get(_LIMIT_FIELDS[against]))
        met = None if ratio is None else _COMPARE[op](ratio, bound)
        targets.append(
            {
                "transport": transport,
                "measure": measure,
                "against": against,
                "target": f"{op} {bound:g}",
                "ratio": ratio,
                "met": met,
            }
        )
    return {"by_transport": out, "targets": targets}


def build(config: dict, limits: dict, peers: dict, server: dict, transports: dict | None = None) -> dict:
    """The one JSON object gcache-bench prints with --json (fields in bench/README.md).
    `transports` ({name: suite}) comes from --transport; then peers["gcache"] is the
    first available one."""
    values = {name: measure_values(p["workloads"]) for name, p in peers.items() if p.get("available")}
    ours = values.get("gcache", {})
    ratios = {
        name: {k: _ratio(ours.get(k), v) for k, v in theirs.items()}
        for name, theirs in values.items()
        if name != "gcache"
    }
    fractions = {}
    for key in ("get_gbps", "put_gbps"):
        if key in ours:
            op = key.split("_")[0]
            fractions[f"{op}_of_loopback_tcp"] = _ratio(ours[key], limits.get("loopback_tcp_gbps"))
            fractions[f"{op}_of_memcpy"] = _ratio(ours[key], limits.get("memcpy_gbps"))
            if limits.get("memcpy_batch_gbps"):
                fractions[f"{op}_of_memcpy_batch"] = _ratio(ours[key], limits["memcpy_batch_gbps"])
            if limits.get("loopback_tcp_batch_gbps"):
                fractions[f"{op}_of_loopback_tcp_batch"] = _ratio(ours[key], limits["loopback_tcp_batch_gbps"])
    targets = []
    for measure, against, op, bound in TARGETS:
        if against == "loopback_tcp":
            ratio = fractions.get(f"{measure.split('_')[0]}_of_loopback_tcp")
        else:
            ratio = ratios.get(against, {}).get(measure)
        met = None
        if ratio is not None:
            met = {">=": ratio >= bound, "<": ratio < bound, "<=": ratio <= bound}[op]
        targets.append({"measure": measure, "against": against, "target": f"{op} {bound}", "ratio": ratio, "met": met})
    report = {
        "gcache_bench": 1,
        "config": config,
        "server": server,
        "limits": limits,
        "peers": peers,
        "measures": values,
        "ratios": ratios,
        "fraction_of_limits": fractions,
        "targets": targets,
    }
    if transports is not None:
        report["transports"] = build_transports(transports, limits, values)
    return report


def _fmt(value, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    v = value * scale
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def render_table(report: dict) -> str:
    cfg = report["config"]
    limits = report["limits"]
    peers = report["peers"]
    names = ["gcache"] + [n for n in peers if n != "gcache"]
    shown = [n for n in names if peers.get(n, {}).get("available")]
    lines = [
        f"gcache-bench: {format_size(cfg['value_size'])} values, batches of {cfg['batch']}, "
        f"{cfg['workers']} {cfg['mode']}, {cfg['duration_s']:g}s per run, medians of {cfg['repeat']} "
        f"(exists: {cfg['exists_keys']} keys; single GET: {format_size(cfg['latency_value_size'])})",
        f"machine: memcpy {limits['memcpy_gbps']:.2f} GB/s (one thread, 256 MiB)"
        + (
            f", {limits['memcpy_batch_gbps']:.2f} GB/s (one thread, one batch's "
            f"{format_size(cfg['value_size'] * cfg['batch'])} into a caller's buffer)"
            if limits.get("memcpy_batch_gbps")
            else ""
        )
        + f"; loopback TCP {limits['loopback_tcp_gbps']:.2f} GB/s"
        + (
            f" (cache-resident 4 MiB buffer; {limits['loopback_tcp_batch_gbps']:.2f} GB/s streaming "
            f"through batch-sized buffers)"
            if limits.get("loopback_tcp_batch_gbps")
            else ""
        )
        + (
            f"; Python TCP ping-pong p50 {limits['python_tcp_pingpong_p50_us']:.1f} us "
            f"({format_size(cfg['latency_value_size'])} reply)"
            if limits.get("python_tcp_pingpong_p50_us")
            else ""
        ),
        "",
    ]
    if peers.get("gcache", {}).get("transport"):
        lines.append(
            f"(gcache = transport {peers['gcache']['transport']}, the first of --transport; every transport is below)"
        )
    header = f"{'measure':<34}" + "".join(f"{n:>10}" for n in shown)
    header += "".join(f"{'gc/' + n[:7]:>12}" for n in shown if n != "gcache")
    lines.append(header)
    for key, workload, _field, label, scale, unit, _hib in MEASURES:
        if workload not in cfg["workloads"]:
            continue
        row = f"{label + ' (' + unit + ')':<34}"
        row += "".join(f"{_fmt(report['measures'][n].get(key), scale):>10}" for n in shown)
        row += "".join(f"{_fmt(report['ratios'][n].get(key)) + 'x':>12}" for n in shown if n != "gcache")
        lines.append(row)
    for name, peer in peers.items():
        if not peer.get("available"):
            lines.append(f"{name}: not run: {peer.get('reason', 'unavailable')}")
        elif not all(w.get("verified", True) for w in peer["workloads"].values()):
            lines.append(f"{name}: WARNING: some bytes read back differed from the bytes put")
    fr = report["fraction_of_limits"]
    if fr:
        parts = [
            f"{op.upper()} {_fmt(fr.get(op + '_of_loopback_tcp'))} of loopback TCP "
            f"({_fmt(fr.get(op + '_of_loopback_tcp_batch'))} of batch-sized loopback), "
            f"{_fmt(fr.get(op + '_of_memcpy'))} of memcpy"
            for op in ("get", "put")
            if op + "_of_memcpy" in fr
        ]
        lines += ["", "gcache as a fraction of the machine: " + "; ".join(parts)]
    lines += ["", "targets (ratio = gcache / against):"]
    for t in report["targets"]:
        verdict = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        lines.append(
            f"  [{verdict}] {t['measure']:<15} vs {t['against']:<13} {t['target']:<7} ratio {_fmt(t['ratio'])}"
        )
    if "transports" in report:
        lines += ["", *render_transports(report)]
    server = report.get("server", {})
    if server.get("exit_code") is not None:
        lines.append(f"\nlocal gcache-server stopped with SIGTERM, exit code {server['exit_code']}")
    return "\n".join(lines)


def _spread(triple, scale: float) -> str:
    if not triple:
        return "-"
    lo, mid, hi = triple
    return f"{_fmt(mid, scale)} [{_fmt(lo, scale)}..{_fmt(hi, scale)}]"


def render_transports(report: dict) -> list[str]:
    """The --transport block: each transport's median [min..max], the peers beside them,
    ratios to the peers, and the per-transport targets."""
    cfg = report["config"]
    section = report["transports"]
    shown = [n for n, t in section["by_transport"].items() if t["available"]]
    peers = [n for n in report["measures"] if n != "gcache"]
    width = 22
    lines = [
        f"by transport: median [min..max] over {cfg['repeat']} runs",
        f"{'measure':<34}"
        + "".join(f"{'gcache/' + n:>{width}}" for n in shown)
        + "".join(f"{n:>{width}}" for n in peers)
        + "".join(f"{n + '/' + p[:8]:>14}" for p in peers for n in shown),
    ]
    for key, workload, _field, label, scale, unit, _hib in MEASURES:
        if workload not in cfg["workloads"]:
            continue
        row = f"{label + ' (' + unit + ')':<34}"
        row += "".join(f"{_spread(section['by_transport'][n]['spread'].get(key), scale):>{width}}" for n in shown)
        for p in peers:
            runs = report["peers"][p]["workloads"].get(workload, {}).get("runs")
            field = next(m[2] for m in MEASURES if m[0] == key)
            triple = None
            if runs:
                values = sorted(r[field] for r in runs)
                triple = [values[0], statistics.median(values), values[-1]]
            row += f"{_spread(triple, scale):>{width}}"
        row += "".join(
            f"{_fmt(section['by_transport'][n]['ratios'][p].get(key)) + 'x':>14}" for p in peers for n in shown
        )
        lines.append(row)
    for name, t in section["by_transport"].items():
        if not t["available"]:
            lines.append(f"gcache/{name}: not run: {t['reason']}")
    limit_names = {
        "memcpy_batch": "memcpy (one thread, same bytes)",
        "loopback_tcp_batch": "batch-sized loopback TCP",
        "python_tcp_pingpong": "Python TCP ping-pong p50",
        "us": "microseconds",
    }
    lines += ["", "transport targets (ratio = gcache / against; for microseconds: the value):"]
    for t in section["targets"]:
        verdict = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        lines.append(
            f"  [{verdict}] {t['transport']:<5} {t['measure']:<15} vs {limit_names[t['against']]:<32} "
            f"{t['target']:<7} ratio {_fmt(t['ratio'])}"
        )
    return lines
