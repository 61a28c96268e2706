"""Turns measurements into ratios, target verdicts, a text table and the JSON object."""
from __future__ import annotations

from gcache.bench.units import format_size

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


def build(config: dict, limits: dict, peers: dict, server: dict) -> dict:
    """The one JSON object gcache-bench prints with --json (fields in bench/README.md)."""
    values = {name: measure_values(p["workloads"]) for name, p in peers.items() if p.get("available")}
    ours = values.get("gcache", {})
    ratios = {
        name: {k: _ratio(ours.get(k), v) for k, v in theirs.items()}
        for name, theirs in values.items() if name != "gcache"
    }
    fractions = {}
    for key in ("get_gbps", "put_gbps"):
        if key in ours:
            op = key.split("_")[0]
            fractions[f"{op}_of_loopback_tcp"] = _ratio(ours[key], limits.get("loopback_tcp_gbps"))
            fractions[f"{op}_of_memcpy"] = _ratio(ours[key], limits.get("memcpy_gbps"))
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
        targets.append({"measure": measure, "against": against, "target": f"{op} {bound}",
                        "ratio": ratio, "met": met})
    return {
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
        f"machine: memcpy {limits['memcpy_gbps']:.2f} GB/s, loopback TCP {limits['loopback_tcp_gbps']:.2f} GB/s"
        + (f" (cache-resident 4 MiB buffer; {limits['loopback_tcp_batch_gbps']:.2f} GB/s streaming "
           f"through batch-sized buffers)" if limits.get("loopback_tcp_batch_gbps") else ""),
        "",
    ]
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
        parts = [f"{op.upper()} {_fmt(fr.get(op + '_of_loopback_tcp'))} of loopback TCP "
                 f"({_fmt(fr.get(op + '_of_loopback_tcp_batch'))} of batch-sized loopback), "
                 f"{_fmt(fr.get(op + '_of_memcpy'))} of memcpy" for op in ("get", "put") if op + "_of_memcpy" in fr]
        lines += ["", "gcache as a fraction of the machine: " + "; ".join(parts)]
    lines += ["", "targets (ratio = gcache / against):"]
    for t in report["targets"]:
        verdict = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        lines.append(f"  [{verdict}] {t['measure']:<15} vs {t['against']:<13} {t['target']:<7} "
                     f"ratio {_fmt(t['ratio'])}")
    server = report.get("server", {})
    if server.get("exit_code") is not None:
        lines.append(f"\nlocal gcache-server stopped with SIGTERM, exit code {server['exit_code']}")
    return "\n".join(lines)
