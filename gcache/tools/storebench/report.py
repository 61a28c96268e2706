"""Turns measurements into ratios, target verdicts, a text table and the JSON object.

Every figure is reported as its median and its [min, median, max] over the rounds. A ratio
is taken within each round (two systems' runs of one workload in the same round ran back
to back; a store's run and the machine's probes of that round), and then reported as the
median and [min, median, max] of those per-round ratios, never as a ratio of medians."""

from __future__ import annotations

from gcache.common.units import format_size
from gcache.tools.storebench.runner import spread

# (key, workload, field, label, scale, unit, higher_is_better)
MEASURES = (
    ("put_gbps", "put", "gbps", "PUT from a caller's buffer", 1.0, "GB/s", True),
    ("put_cpu_us", "put", "cpu_us_per_call", "PUT client CPU per call", 1.0, "us", False),
    ("get_gbps", "get", "gbps", "GET into a caller's buffer", 1.0, "GB/s", True),
    ("get_cpu_us", "get", "cpu_us_per_call", "GET client CPU per call", 1.0, "us", False),
    ("exists_p50_us", "exists", "p50_us", "batch_is_exist p50", 1e-3, "ms", False),
    ("exists_p99_us", "exists", "p99_us", "batch_is_exist p99", 1e-3, "ms", False),
    ("latency_p50_us", "latency", "p50_us", "single GET p50", 1.0, "us", False),
    ("latency_p99_us", "latency", "p99_us", "single GET p99", 1.0, "us", False),
    ("latency_cpu_us", "latency", "cpu_us_per_call", "single GET client CPU per call", 1.0, "us", False),
    ("exists_cpu_us", "exists", "cpu_us_per_call", "batch_is_exist client CPU per call", 1e-3, "ms", False),
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
# except against "us", where the bound is the measure itself in microseconds. The bounds
# are issue 39's: each operation against its own floor (the store's end of it in memory
# larger than the cache, as an arena is).
TRANSPORT_TARGETS = (
    ("shm", "get_gbps", "memcpy_batch", ">=", 1.0),
    ("shm", "put_gbps", "memcpy_put", ">=", 0.8),
    ("shm", "latency_p50_us", "us", "<=", 15.0),
    ("shm", "latency_p50_us", "python_tcp_pingpong", "<=", 0.6),
    ("tcp", "put_gbps", "loopback_tcp_put", ">=", 0.9),
    ("tcp", "get_gbps", "loopback_tcp_get", ">=", 0.9),
)
_LIMIT_FIELDS = {
    "memcpy_batch": "memcpy_batch_gbps",
    "memcpy_put": "memcpy_put_gbps",
    "loopback_tcp_batch": "loopback_tcp_batch_gbps",
    "loopback_tcp_put": "loopback_tcp_put_gbps",
    "loopback_tcp_get": "loopback_tcp_get_gbps",
    "python_tcp_pingpong": "python_tcp_pingpong_p50_us",
}
_COMPARE = {">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}


# Machine limits a store's measure is divided by, per round: (name, limits field, label).
# Each operation's own floor first; the batch-sized loopback (both ends in a batch's
# buffer, partly cache-resident) stays for comparison with older reports.
LIMITS_FOR = {
    "put_gbps": (
        ("loopback_tcp_put", "loopback_tcp_put_gbps", "loopback TCP into an arena"),
        ("loopback_tcp_batch", "loopback_tcp_batch_gbps", "batch-sized loopback TCP"),
        ("memcpy_put", "memcpy_put_gbps", "memcpy into an arena"),
    ),
    "get_gbps": (
        ("loopback_tcp_get", "loopback_tcp_get_gbps", "loopback TCP out of an arena"),
        ("loopback_tcp_batch", "loopback_tcp_batch_gbps", "batch-sized loopback TCP"),
        ("memcpy_batch", "memcpy_batch_gbps", "memcpy out of an arena"),
    ),
    "latency_p50_us": (("python_tcp_pingpong", "python_tcp_pingpong_p50_us", "Python TCP ping-pong p50"),),
}


def measure_values(workloads: dict) -> dict:
    """{measure key: median over the rounds} for the workloads a system ran."""
    out = {}
    for key, workload, field, *_ in MEASURES:
        if field in workloads.get(workload, {}):  # an older report may lack a field
            out[key] = workloads[workload][field]
    return out


def measure_rounds(workloads: dict) -> dict:
    """{measure key: {round: value}}: each run's figure by the round it ran in (runs of an
    older report without `round`: by position)."""
    out = {}
    for key, workload, field, *_ in MEASURES:
        runs = workloads.get(workload, {}).get("runs")
        if runs and all(field in r for r in runs):
            out[key] = {r.get("round", i): r[field] for i, r in enumerate(runs)}
    return out


def limit_rounds(limits: dict, field: str) -> dict:
    """{round: value} of one machine probe (`<field>_runs` is in round order)."""
    return dict(enumerate(limits.get(f"{field}_runs") or []))


def measure_spread(workloads: dict) -> dict:
    """{measure key: [min, median, max]} over the rounds of each workload."""
    return {key: spread(list(by_round.values())) for key, by_round in measure_rounds(workloads).items()}


def ratio_spread(ours: dict, theirs: dict) -> list[float] | None:
    """[min, median, max] of ours[r] / theirs[r] over the rounds both have; None if none."""
    ratios = [ours[r] / theirs[r] for r in ours if theirs.get(r)]
    return spread(ratios) if ratios else None


def _median(triple):
    return None if triple is None else triple[1]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def system_entry(workloads: dict, others: dict | None, limits: dict) -> dict:
    """One system's medians and spreads, and (for a GCache system) its per-round ratios
    against `others` ({peer: its measure_rounds}) and against the machine's limits."""
    rounds = measure_rounds(workloads)
    entry = {"measures": measure_values(workloads), "spread": measure_spread(workloads)}
    if others is None:  # a peer: no ratios of its own
        return entry
    vs: dict[str, dict] = {}
    for peer, theirs in others.items():
        vs[peer] = {k: ratio_spread(v, theirs[k]) for k, v in rounds.items() if k in theirs}
    for key, by_round in rounds.items():
        for name, field, _label in LIMITS_FOR.get(key, ()):
            if limits.get(f"{field}_runs"):
                vs.setdefault(name, {})[key] = ratio_spread(by_round, limit_rounds(limits, field))
    entry["vs"] = {name: {k: t for k, t in by.items() if t is not None} for name, by in vs.items()}
    return entry


def build_systems(peers: dict, transports: dict | None, limits: dict, order: list | None) -> dict:
    """{system: system_entry} for every system that ran, in the order the rounds ran them."""
    gcache = (
        {f"gcache/{t}": v for t, v in transports.items() if v.get("available")}
        if transports is not None
        else ({"gcache": peers["gcache"]} if peers.get("gcache", {}).get("available") else {})
    )
    others = {n: p for n, p in peers.items() if n != "gcache" and p.get("available")}
    rounds_of = {n: measure_rounds(p["workloads"]) for n, p in others.items()}
    out = {name: system_entry(v["workloads"], rounds_of, limits) for name, v in gcache.items()}
    out.update({name: system_entry(p["workloads"], None, limits) for name, p in others.items()})
    if order:
        ran = list(dict.fromkeys(o["system"] for o in order))
        out = {n: out[n] for n in ran if n in out} | {n: v for n, v in out.items() if n not in ran}
    return out


def build_transports(transports: dict, limits: dict, systems: dict) -> dict:
    """Each transport's medians, spreads, per-round ratios to the peers, and its targets."""
    out = {}
    for name, t in transports.items():
        if not t.get("available"):
            out[name] = {"available": False, "reason": t.get("reason")}
            continue
        entry = systems[f"gcache/{name}"]
        peer_spreads = {p: by for p, by in entry["vs"].items() if p not in _LIMIT_FIELDS}
        out[name] = {
            "available": True,
            "measures": entry["measures"],
            "spread": entry["spread"],
            "ratios": {p: {k: _median(t3) for k, t3 in by.items()} for p, by in peer_spreads.items()},
            "ratio_spread": peer_spreads,
        }
    targets = []
    for transport, measure, against, op, bound in TRANSPORT_TARGETS:
        if transport not in transports:
            continue
        entry = systems.get(f"gcache/{transport}", {})
        if against == "us":
            triple = entry.get("spread", {}).get(measure)
        else:
            triple = entry.get("vs", {}).get(against, {}).get(measure)
        ratio = _median(triple)
        met = None if ratio is None else _COMPARE[op](ratio, bound)
        targets.append(
            {
                "transport": transport,
                "measure": measure,
                "against": against,
                "target": f"{op} {bound:g}",
                "ratio": ratio,
                "spread": triple,
                "met": met,
            }
        )
    return {"by_transport": out, "targets": targets}


def build(
    config: dict,
    limits: dict,
    peers: dict,
    server: dict,
    transports: dict | None = None,
    order: list | None = None,
) -> dict:
    """The one JSON object gcache-bench prints with --json (fields in bench/README.md).
    `transports` ({name: suite}) comes from --transport; then peers["gcache"] is the
    first available one. `order`: every run as it ran ({"round", "workload", "system"})."""
    values = {name: measure_values(p["workloads"]) for name, p in peers.items() if p.get("available")}
    spreads = {name: measure_spread(p["workloads"]) for name, p in peers.items() if p.get("available")}
    ours = measure_rounds(peers["gcache"]["workloads"]) if peers.get("gcache", {}).get("available") else {}
    ratio_spreads = {}
    for name, p in peers.items():
        if name == "gcache" or not p.get("available"):
            continue
        theirs = measure_rounds(p["workloads"])
        ratio_spreads[name] = {k: ratio_spread(ours[k], v) for k, v in theirs.items() if k in ours}
    ratios = {name: {k: _median(t) for k, t in by.items()} for name, by in ratio_spreads.items()}
    fraction_spreads = {}
    for key in ("get_gbps", "put_gbps"):
        if key in ours:
            op = key.split("_")[0]
            for suffix, field in (
                ("loopback_tcp", "loopback_tcp_gbps"),
                ("memcpy", "memcpy_gbps"),
                ("memcpy_batch", "memcpy_batch_gbps"),
                ("memcpy_put", "memcpy_put_gbps"),
                ("loopback_tcp_batch", "loopback_tcp_batch_gbps"),
                ("loopback_tcp_put", "loopback_tcp_put_gbps"),
                ("loopback_tcp_get", "loopback_tcp_get_gbps"),
            ):
                if limits.get(f"{field}_runs"):
                    fraction_spreads[f"{op}_of_{suffix}"] = ratio_spread(ours[key], limit_rounds(limits, field))
    fractions = {k: _median(t) for k, t in fraction_spreads.items()}
    targets = []
    for measure, against, op, bound in TARGETS:
        if against == "loopback_tcp":
            triple = fraction_spreads.get(f"{measure.split('_')[0]}_of_loopback_tcp")
        else:
            triple = ratio_spreads.get(against, {}).get(measure)
        ratio = _median(triple)
        met = None if ratio is None else _COMPARE[op](ratio, bound)
        targets.append(
            {
                "measure": measure,
                "against": against,
                "target": f"{op} {bound}",
                "ratio": ratio,
                "spread": triple,
                "met": met,
            }
        )
    systems = build_systems(peers, transports, limits, order)
    report = {
        "gcache_bench": 1,
        "config": config,
        "server": server,
        "limits": limits,
        "limits_spread": {
            k: spread(limits[f"{k}_runs"]) for k in list(limits) if not k.endswith("_runs") and limits.get(f"{k}_runs")
        },
        "peers": peers,
        "run_order": order or [],
        "systems": systems,
        "measures": values,
        "spread": spreads,
        "ratios": ratios,
        "ratio_spread": ratio_spreads,
        "fraction_of_limits": fractions,
        "fraction_of_limits_spread": fraction_spreads,
        "targets": targets,
    }
    if transports is not None:
        report["transports"] = build_transports(transports, limits, systems)
    return report


def _fmt(value, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    v = value * scale
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def _spread(triple, scale: float = 1.0) -> str:
    """ "median [min..max]" of a [min, median, max] triple."""
    if not triple:
        return "-"
    lo, mid, hi = triple
    return f"{_fmt(mid, scale)} [{_fmt(lo, scale)}..{_fmt(hi, scale)}]"


LABEL_WIDTH = 46
COLUMN_WIDTH = 10


def _row(label: str, triple, scale: float = 1.0) -> str:
    cells = ["-"] * 3 if not triple else [_fmt(triple[1], scale), _fmt(triple[0], scale), _fmt(triple[2], scale)]
    return f"{label:<{LABEL_WIDTH}}" + "".join(f"{c:>{COLUMN_WIDTH}}" for c in cells)


def _heading(label: str) -> str:
    return f"{label:<{LABEL_WIDTH}}" + "".join(f"{c:>{COLUMN_WIDTH}}" for c in ("median", "min", "max"))


def _machine_rows(cfg: dict) -> tuple:
    batch = format_size(cfg["value_size"] * cfg["batch"])
    return (
        ("memcpy_gbps", "memcpy, one thread, 256 MiB (GB/s)"),
        ("memcpy_batch_gbps", f"memcpy, arena -> {batch} batch, 1 thread (GB/s)"),
        ("memcpy_put_gbps", f"memcpy, {batch} batch -> arena, 1 thread (GB/s)"),
        ("loopback_tcp_gbps", "loopback TCP, 4 MiB cache-resident (GB/s)"),
        ("loopback_tcp_batch_gbps", f"loopback TCP, {batch} buffers (GB/s)"),
        ("loopback_tcp_put_gbps", f"loopback TCP, {batch} batch -> arena (GB/s)"),
        ("loopback_tcp_get_gbps", f"loopback TCP, arena -> {batch} batch (GB/s)"),
        ("python_tcp_pingpong_p50_us", f"Python TCP ping-pong p50, {format_size(cfg['latency_value_size'])} (us)"),
    )


def render_table(report: dict) -> str:
    """The text gcache-bench prints: the machine, then per measure every system's median
    [min, max] over the rounds and the per-round ratios, then the targets."""
    cfg = report["config"]
    limits = report["limits"]
    peers = report["peers"]
    systems = report.get("systems") or {}
    lines = [
        f"gcache-bench: {format_size(cfg['value_size'])} values, batches of {cfg['batch']}, "
        f"{cfg['workers']} {cfg['mode']}, {cfg['duration_s']:g}s per run, {cfg['repeat']} rounds "
        f"(exists: {cfg['exists_keys']} keys; single GET: {format_size(cfg['latency_value_size'])})",
        "each round measures the machine, then runs each workload on "
        + (", ".join(systems) or "no system")
        + " in turn",
        "figures: median, min, max over the rounds; a / b: the ratio within each round, then median, min, max",
        "",
        _heading("machine"),
    ]
    for key, label in _machine_rows(cfg):
        if limits.get(f"{key}_runs"):
            lines.append(_row(label, spread(limits[f"{key}_runs"])))
    for key, workload, _field, label, scale, unit, _hib in MEASURES:
        if workload not in cfg["workloads"]:
            continue
        lines += ["", _heading(f"{label} ({unit})")]
        for name, entry in systems.items():
            lines.append(_row(f"  {name}", entry["spread"].get(key), scale))
        for name, entry in systems.items():
            for against, by in entry.get("vs", {}).items():
                if key in by:
                    label_of = next((lb for n, _f, lb in LIMITS_FOR.get(key, ()) if n == against), against)
                    lines.append(_row(f"  {name} / {label_of}", by[key]))
    for name, peer in peers.items():
        if not peer.get("available"):
            lines.append(f"{name}: not run: {peer.get('reason', 'unavailable')}")
        elif not all(w.get("verified", True) for w in peer["workloads"].values()):
            lines.append(f"{name}: WARNING: some bytes read back differed from the bytes put")
    for name, t in report.get("transports", {}).get("by_transport", {}).items():
        if not t["available"]:
            lines.append(f"gcache/{name}: not run: {t['reason']}")
    first = peers.get("gcache", {}).get("transport")
    gc = f"gcache/{first}" if first else "gcache"
    lines += ["", f"targets (ratio = {gc} / against, per round; median [min..max]):"]
    for t in report["targets"]:
        verdict = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        lines.append(
            f"  [{verdict}] {t['measure']:<15} vs {t['against']:<13} {t['target']:<7} "
            f"ratio {_spread(t.get('spread')) if t.get('spread') else _fmt(t['ratio'])}"
        )
    if "transports" in report:
        lines += ["", *render_transport_targets(report)]
    server = report.get("server", {})
    if server.get("exit_code") is not None:
        lines.append(f"\nlocal gcache-server stopped with SIGTERM, exit code {server['exit_code']}")
    return "\n".join(lines)


def render_transport_targets(report: dict) -> list[str]:
    """The --transport targets, each with the median [min..max] of its per-round ratio."""
    limit_names = {
        "memcpy_batch": "memcpy out of an arena",
        "memcpy_put": "memcpy into an arena",
        "loopback_tcp_batch": "batch-sized loopback TCP",
        "loopback_tcp_put": "loopback TCP into an arena",
        "loopback_tcp_get": "loopback TCP out of an arena",
        "python_tcp_pingpong": "Python TCP ping-pong p50",
        "us": "microseconds",
    }
    lines = ["transport targets (ratio = gcache / against, per round; for microseconds: the value):"]
    for t in report["transports"]["targets"]:
        verdict = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        lines.append(
            f"  [{verdict}] {t['transport']:<5} {t['measure']:<15} vs {limit_names[t['against']]:<32} "
            f"{t['target']:<7} ratio {_spread(t.get('spread')) if t.get('spread') else _fmt(t['ratio'])}"
        )
    return lines
