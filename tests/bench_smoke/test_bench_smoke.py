"""gcache-bench against a real gcache-server and a real redis-server: fields and exact byte counts,
the order the systems ran in (interleaved round by round), and every figure's spread.

No timing assertions: only that every figure exists, is positive where it must
be, and that the counts add up exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from gcache.common.units import parse_duration, parse_size
from gcache.tools.storebench import main as bench_main
from gcache.tools.storebench import report as bench_report

pytestmark = pytest.mark.process  # starts processes

VALUE = 64 << 10
BATCH = 8
EXISTS_KEYS = 200
SMALL = [
    "--duration",
    "0.2s",
    "--repeat",
    "2",
    "--working-set",
    "2MiB",
    "--value-size",
    "64KiB",
    "--batch",
    str(BATCH),
    "--exists-keys",
    str(EXISTS_KEYS),
    "--no-progress",
]


def check_workloads(workloads: dict, repeat: int) -> None:
    assert set(workloads) == {"put", "get", "exists", "latency"}
    for name, w in workloads.items():
        assert w["verified"] is True, name
        assert w["misses"] == 0, name
        assert w["repeats"] == repeat and [r["round"] for r in w["runs"]] == list(range(repeat))  # every run kept
        for field, (lo, mid, hi) in w["spread"].items():
            assert lo <= mid <= hi, (name, field)
            assert mid == pytest.approx(w[field]) and lo == min(r[field] for r in w["runs"]), (name, field)
        assert w["calls"] == sum(r["calls"] for r in w["runs"]) > 0
        assert w["bytes"] == sum(r["bytes"] for r in w["runs"])
        assert 0 < w["p50_us"] <= w["p99_us"] <= w["max_us"]
        assert w["calls_per_s"] > 0
    for name in ("put", "get"):
        w = workloads[name]
        assert w["keys"] == w["calls"] * BATCH
        assert w["bytes"] == w["keys"] * VALUE  # every key moved exactly one value
        assert w["gbps"] > 0
    assert workloads["exists"]["keys"] == workloads["exists"]["calls"] * EXISTS_KEYS
    assert workloads["exists"]["bytes"] == 0
    assert workloads["latency"]["bytes"] == workloads["latency"]["keys"] * 4096


def check_interleaved(report: dict, systems: list[str], workloads: list[str], repeat: int) -> None:
    """The systems ran each workload in turn, round after round: gcache, redis, gcache, redis, ..."""
    assert report["config"]["systems"] == systems
    assert report["run_order"] == [
        {"round": r, "workload": w, "system": s} for r in range(repeat) for w in workloads for s in systems
    ]
    assert list(report["systems"]) == systems
    for name, entry in report["systems"].items():
        for key, (lo, mid, hi) in entry["spread"].items():
            assert lo <= mid <= hi, (name, key)
        for against, by in entry.get("vs", {}).items():
            for key, (lo, mid, hi) in by.items():
                assert 0 < lo <= mid <= hi, (name, against, key)
    for probe, (lo, mid, hi) in report["limits_spread"].items():
        assert len(report["limits"][f"{probe}_runs"]) == repeat  # one probe per round
        assert lo <= mid <= hi and mid == pytest.approx(report["limits"][probe])


def per_round_ratios(report: dict, ours: str, theirs: str, key: str) -> list[float]:
    """ours / theirs within each round, from the runs the JSON keeps."""
    workload, field = next((m[1], m[2]) for m in bench_report.MEASURES if m[0] == key)
    a = {r["round"]: r[field] for r in report["peers"][ours]["workloads"][workload]["runs"]}
    b = {r["round"]: r[field] for r in report["peers"][theirs]["workloads"][workload]["runs"]}
    return sorted(a[r] / b[r] for r in a)


def test_bench_gcache_vs_redis(server, redis_server):
    report = bench_main.run(["--server", server.address, "--vs", "redis", "--redis-url", redis_server, *SMALL])
    assert report["config"]["value_size"] == VALUE and report["config"]["repeat"] == 2
    assert report["limits"]["memcpy_gbps"] > 0 and report["limits"]["loopback_tcp_gbps"] > 0
    assert len(report["limits"]["memcpy_gbps_runs"]) == 2
    for name in ("gcache", "redis"):
        assert report["peers"][name]["available"] is True
        check_workloads(report["peers"][name]["workloads"], repeat=2)
    check_interleaved(report, ["gcache", "redis"], ["put", "get", "exists", "latency"], 2)
    for key, ratio in report["ratios"]["redis"].items():  # taken per round, then the median of those
        ratios = per_round_ratios(report, "gcache", "redis", key)
        assert report["ratio_spread"]["redis"][key] == pytest.approx(
            [ratios[0], (ratios[0] + ratios[1]) / 2, ratios[1]]
        )
        assert ratio == pytest.approx(report["ratio_spread"]["redis"][key][1])
    get_runs = report["peers"]["gcache"]["workloads"]["get"]["runs"]
    fractions = sorted(r["gbps"] / report["limits"]["loopback_tcp_gbps_runs"][r["round"]] for r in get_runs)
    assert report["fraction_of_limits_spread"]["get_of_loopback_tcp"] == pytest.approx(
        [fractions[0], sum(fractions) / 2, fractions[1]]
    )
    text = bench_report.render_table(report)
    assert "each round measures the machine, then runs each workload on gcache, redis in turn" in text
    assert any(line.split()[:3] == ["gcache", "/", "redis"] and len(line.split()) == 6 for line in text.splitlines())
    verdicts = {(t["measure"], t["against"]): t["met"] for t in report["targets"]}
    assert len(verdicts) == 8
    assert verdicts[("get_gbps", "mooncake")] is None  # mooncake was not asked for
    assert isinstance(verdicts[("get_gbps", "redis")], bool)
    assert report["server"]["local"] is False and report["server"]["exit_code"] is None
    assert server.alive()


def test_bench_cli_json_with_local_server_and_processes(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gcache.tools.storebench.main",
            "--json",
            "--processes",
            "2",
            "--data-dir",
            str(tmp_path),
            "--memory",
            "64MiB",
            "--disk",
            "128MiB",
            "--workload",
            "put,get",
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert report["config"]["workers"] == 2 and report["config"]["mode"] == "processes"
    assert report["server"]["local"] is True and report["server"]["exit_code"] == 0  # SIGTERM, clean
    workloads = report["peers"]["gcache"]["workloads"]
    assert set(workloads) == {"put", "get"}
    for w in workloads.values():
        assert w["verified"] is True and w["misses"] == 0
        assert w["bytes"] == w["keys"] * VALUE


def test_bench_vs_mooncake_runs_or_says_why(server):
    report = bench_main.run(
        [
            "--server",
            server.address,
            "--vs",
            "mooncake",
            "--mooncake-segment",
            "96MiB",
            "--workload",
            "get,exists",
            *SMALL,
        ]
    )
    mooncake = report["peers"]["mooncake"]
    if importlib.util.find_spec("mooncake") is not None and os.geteuid() == 0:
        # setup.sh installed the wheel: then a failure to run is a bug, not a reason
        assert mooncake["available"], mooncake.get("reason")
    if mooncake["available"]:
        w = mooncake["workloads"]
        # Mooncake Store itself misses some keys when this machine is loaded (seen with the old
        # bench too): every byte it returns is verified, and most keys come back.
        got = w["get"]["bytes"]
        assert w["get"]["verified"] is True and got % VALUE == 0 and 0 < got <= w["get"]["keys"] * VALUE
        assert w["exists"]["misses"] == 0
        assert len(w["get"]["runs"]) == 2 and len(w["exists"]["runs"]) == 2
        assert report["ratios"]["mooncake"]["get_gbps"] > 0
        # Mooncake's side stays up between its runs, so its runs alternate with GCache's
        check_interleaved(report, ["gcache", "mooncake"], ["get", "exists"], 2)
    else:
        assert mooncake["reason"] and "\n" not in mooncake["reason"]
        assert f"mooncake: not run: {mooncake['reason']}" in bench_report.render_table(report)
        check_interleaved(report, ["gcache"], ["get", "exists"], 2)
    assert report["peers"]["gcache"]["available"] is True


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--value-size", "1KiB"),
        ("--value-size", "32MiB"),
        ("--batch", "0"),
        ("--duration", "ten"),
        ("--vs", "memcached"),
        ("--workload", "scan"),
    ],
)
def test_bench_rejects_bad_flags(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main.parse_args([flag, value])
    assert exc.value.code == 2
    assert flag.lstrip("-").split("-")[0] in capsys.readouterr().err


def test_units():
    assert parse_size("256KiB") == 256 << 10
    assert parse_size("16MiB") == 16 << 20
    assert parse_size("4k") == 4096
    assert parse_size("1GB") == 10**9
    assert parse_duration("10s") == 10.0 and parse_duration("500ms") == 0.5
    for bad in ("", "12XB", "-1KiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_bench_per_transport_beside_the_machine(server):
    report = bench_main.run(
        ["--server", server.address, "--transport", "tcp,shm,rdma", "--workload", "put,get,latency", *SMALL]
    )
    assert report["config"]["transports"] == ["tcp", "shm", "rdma"]
    limits = report["limits"]
    for probe in ("memcpy_batch_gbps", "memcpy_put_gbps", "loopback_tcp_put_gbps", "loopback_tcp_get_gbps"):
        assert limits[probe] > 0 and len(limits[f"{probe}_runs"]) == 2, probe
    assert limits["python_tcp_pingpong_p50_us"] > 0 and len(limits["python_tcp_pingpong_p50_us_runs"]) == 2
    by = report["transports"]["by_transport"]
    assert list(by) == ["tcp", "shm", "rdma"]
    assert by["tcp"]["available"] is True  # tcp always reaches a server
    assert report["peers"]["gcache"]["transport"] == "tcp"  # the first available one
    for name, t in by.items():
        if not t["available"]:  # skipped with a one-line reason
            assert t["reason"] and "\n" not in t["reason"], name
            continue
        workloads = report["peers"]["gcache"]["workloads"] if name == "tcp" else None
        for key, (lo, mid, hi) in t["spread"].items():
            assert lo <= mid <= hi, (name, key)
            assert mid == pytest.approx(t["measures"][key]), (name, key)
        assert set(t["spread"]) == {"put_gbps", "get_gbps", "latency_p50_us", "latency_p99_us"} | {
            "put_cpu_us",
            "get_cpu_us",
            "latency_cpu_us",
        }
        assert all(t["measures"][k] > 0 for k in ("put_cpu_us", "get_cpu_us", "latency_cpu_us"))  # client CPU per call
        if workloads is not None:
            for w in ("put", "get"):
                assert workloads[w]["verified"] is True and workloads[w]["misses"] == 0
                assert workloads[w]["bytes"] == workloads[w]["keys"] * VALUE
    available = [f"gcache/{n}" for n, t in by.items() if t["available"]]
    check_interleaved(report, available, ["put", "get", "latency"], 2)
    targets = report["transports"]["targets"]
    assert {(t["transport"], t["measure"], t["against"]) for t in targets} == {
        ("shm", "get_gbps", "memcpy_batch"),
        ("shm", "put_gbps", "memcpy_put"),
        ("shm", "latency_p50_us", "us"),
        ("shm", "latency_p50_us", "python_tcp_pingpong"),
        ("tcp", "put_gbps", "loopback_tcp_put"),
        ("tcp", "get_gbps", "loopback_tcp_get"),
    }
    tcp_put = next(t for t in targets if t["transport"] == "tcp" and t["measure"] == "put_gbps")
    runs = report["peers"]["gcache"]["workloads"]["put"]["runs"]  # the tcp suite: the first transport
    ratios = sorted(r["gbps"] / limits["loopback_tcp_put_gbps_runs"][r["round"]] for r in runs)
    assert tcp_put["spread"] == pytest.approx([ratios[0], sum(ratios) / 2, ratios[1]])
    assert tcp_put["ratio"] == pytest.approx(tcp_put["spread"][1])
    assert isinstance(tcp_put["met"], bool)
    text = bench_report.render_table(report)
    assert "targets (ratio = gcache/tcp / against, per round; median [min..max])" in text
    rows = [line.split() for line in text.splitlines()]
    for name in available:  # every system's row: median, min, max
        put = report["systems"][name]["spread"]["put_gbps"]
        assert [name, *(bench_report._fmt(v) for v in (put[1], put[0], put[2]))] in rows
    if not by["rdma"]["available"]:
        assert f"gcache/rdma: not run: {by['rdma']['reason']}" in text


def test_bench_rejects_unknown_transport(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main.parse_args(["--transport", "tcp,carrier-pigeon"])
    assert exc.value.code == 2
    assert "transport" in capsys.readouterr().err
