"""gcache-bench against a real gcache-server and a real redis-server: fields and exact byte counts.

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
        assert w["repeats"] == repeat and len(w["runs"]) == repeat
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


def test_bench_gcache_vs_redis(server, redis_server):
    report = bench_main.run(["--server", server.address, "--vs", "redis", "--redis-url", redis_server, *SMALL])
    assert report["config"]["value_size"] == VALUE and report["config"]["repeat"] == 2
    assert report["limits"]["memcpy_gbps"] > 0 and report["limits"]["loopback_tcp_gbps"] > 0
    assert len(report["limits"]["memcpy_gbps_runs"]) == 2
    for name in ("gcache", "redis"):
        assert report["peers"][name]["available"] is True
        check_workloads(report["peers"][name]["workloads"], repeat=2)
    ours, theirs = report["measures"]["gcache"], report["measures"]["redis"]
    for key, ratio in report["ratios"]["redis"].items():
        assert ratio == pytest.approx(ours[key] / theirs[key])
    assert report["fraction_of_limits"]["get_of_loopback_tcp"] == pytest.approx(
        ours["get_gbps"] / report["limits"]["loopback_tcp_gbps"]
    )
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
        assert w["get"]["verified"] is True and w["get"]["bytes"] == w["get"]["keys"] * VALUE
        assert w["exists"]["misses"] == 0
        assert report["ratios"]["mooncake"]["get_gbps"] > 0
    else:
        assert mooncake["reason"] and "\n" not in mooncake["reason"]
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
    assert limits["memcpy_batch_gbps"] > 0 and len(limits["memcpy_batch_gbps_runs"]) == 2
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
        assert set(t["spread"]) == {"put_gbps", "get_gbps", "latency_p50_us", "latency_p99_us"}
        if workloads is not None:
            for w in ("put", "get"):
                assert workloads[w]["verified"] is True and workloads[w]["misses"] == 0
                assert workloads[w]["bytes"] == workloads[w]["keys"] * VALUE
    targets = report["transports"]["targets"]
    assert {(t["transport"], t["measure"], t["against"]) for t in targets} == {
        ("shm", "get_gbps", "memcpy_batch"),
        ("shm", "put_gbps", "memcpy_batch"),
        ("shm", "latency_p50_us", "us"),
        ("shm", "latency_p50_us", "python_tcp_pingpong"),
        ("tcp", "put_gbps", "loopback_tcp_batch"),
        ("tcp", "get_gbps", "loopback_tcp_batch"),
    }
    tcp_put = next(t for t in targets if t["transport"] == "tcp" and t["measure"] == "put_gbps")
    assert tcp_put["ratio"] == pytest.approx(by["tcp"]["measures"]["put_gbps"] / limits["loopback_tcp_batch_gbps"])
    assert isinstance(tcp_put["met"], bool)
    text = bench_report.render_table(report)
    assert "by transport: median [min..max] over 2 runs" in text and "gcache/tcp" in text
    assert "(gcache = transport tcp, the first of --transport" in text
    if not by["rdma"]["available"]:
        assert f"gcache/rdma: not run: {by['rdma']['reason']}" in text


def test_bench_rejects_unknown_transport(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main.parse_args(["--transport", "tcp,carrier-pigeon"])
    assert exc.value.code == 2
    assert "transport" in capsys.readouterr().err
