"""gcache-bench's rounds and ratios without any store: systems interleave round by round, a
peer that fails leaves the later rounds with its reason, and every ratio is taken within a
round (then its min / median / max), never as a ratio of medians."""

from __future__ import annotations

import pytest

from gcache.tools.storebench import report as bench_report
from gcache.tools.storebench.runner import System, combine_repeats, run_rounds

WORKLOADS = ["put", "latency"]


def figures(gbps: float, p50: float = 10.0) -> dict:
    return {
        "calls": 2,
        "keys": 16,
        "bytes": 1024,
        "misses": 0,
        "seconds": 1.0,
        "gbps": gbps,
        "calls_per_s": 2.0,
        "keys_per_s": 16.0,
        "p50_us": p50,
        "p99_us": 2 * p50,
        "mean_us": p50,
        "max_us": 3 * p50,
        "verified": True,
    }


class Recorder:
    """Fake systems that log each call, so the test sees the order things ran in."""

    def __init__(self):
        self.calls: list[tuple] = []

    def system(self, name, values, fail_at=None, required=False):
        def run(workload, prefix):
            self.calls.append((name, workload, prefix))
            if fail_at is not None and len([c for c in self.calls if c[0] == name]) > fail_at:
                raise RuntimeError(f"{name} went away\nsecond line")
            return figures(values[len([c for c in self.calls if c[0] == name]) - 1])

        return System(name, run, required=required)

    def limits(self):
        self.calls.append(("limits",))
        return {"memcpy_gbps": 10.0}


def test_rounds_interleave_systems_per_workload_and_round():
    rec = Recorder()
    systems = [rec.system(n, list(range(1, 20))) for n in ("gcache", "redis", "mooncake")]
    rounds = run_rounds(systems, WORKLOADS, 3, "tag", rec.limits)
    expected = []
    for r in range(3):
        expected.append(("limits",))
        for w in WORKLOADS:
            expected += [(n, w, f"tag/{n}/{w}/r{r}") for n in ("gcache", "redis", "mooncake")]
    assert rec.calls == expected
    assert rounds.order == [
        {"round": r, "workload": w, "system": n}
        for r in range(3)
        for w in WORKLOADS
        for n in ("gcache", "redis", "mooncake")
    ]
    assert len(rounds.limits) == 3 and rounds.failed == {}
    for n in ("gcache", "redis", "mooncake"):
        for w in WORKLOADS:
            assert [run["round"] for run in rounds.runs[n][w]] == [0, 1, 2]


def test_a_failing_peer_leaves_later_rounds_with_a_one_line_reason():
    rec = Recorder()
    said = []
    systems = [rec.system("gcache", list(range(1, 20)), required=True), rec.system("redis", [1, 2, 3], fail_at=2)]
    rounds = run_rounds(systems, WORKLOADS, 3, "tag", say=said.append)
    assert [o["system"] for o in rounds.order] == ["gcache", "redis", "gcache", "redis"] + ["gcache"] * 4
    assert rounds.failed["redis"].startswith("failed in round 2, put: RuntimeError: redis went away")
    assert "\n" not in rounds.failed["redis"] and said
    assert len(rounds.runs["gcache"]["put"]) == 3


def test_a_failing_gcache_ends_the_bench():
    rec = Recorder()
    with pytest.raises(RuntimeError, match="gcache went away"):
        run_rounds([rec.system("gcache", [1], fail_at=0, required=True)], WORKLOADS, 2, "tag")


def workloads(gbps: list[float], p50: list[float]) -> dict:
    return {
        "put": combine_repeats([dict(figures(g), round=r) for r, g in enumerate(gbps)]),
        "latency": combine_repeats([dict(figures(1.0, p), round=r) for r, p in enumerate(p50)]),
    }


CONFIG = {
    "value_size": 64 << 10,
    "batch": 8,
    "workers": 1,
    "mode": "threads",
    "duration_s": 1.0,
    "repeat": 3,
    "exists_keys": 10,
    "latency_value_size": 4096,
    "workloads": WORKLOADS,
}
LIMITS = {
    "memcpy_gbps": 10.0,
    "memcpy_gbps_runs": [10.0, 10.0, 10.0],
    "loopback_tcp_batch_gbps": 4.0,
    "loopback_tcp_batch_gbps_runs": [1.0, 4.0, 9.0],
    "python_tcp_pingpong_p50_us": 50.0,
    "python_tcp_pingpong_p50_us_runs": [50.0, 50.0, 50.0],
}


def test_ratios_are_taken_per_round_then_summarized():
    # Per round gcache/redis = 2, 1, 3 (median 2); the ratio of the medians would be 4 / 3.
    peers = {
        "gcache": {"available": True, "workloads": workloads([2.0, 4.0, 9.0], [10.0, 20.0, 30.0])},
        "redis": {"available": True, "workloads": workloads([1.0, 4.0, 3.0], [20.0, 20.0, 20.0])},
    }
    order = [{"round": r, "workload": w, "system": n} for r in range(3) for w in WORKLOADS for n in ("gcache", "redis")]
    report = bench_report.build(CONFIG, LIMITS, peers, {"exit_code": None}, None, order)
    assert report["ratio_spread"]["redis"]["put_gbps"] == pytest.approx([1.0, 2.0, 3.0])
    assert report["ratios"]["redis"]["put_gbps"] == pytest.approx(2.0)
    assert report["spread"]["gcache"]["put_gbps"] == [2.0, 4.0, 9.0]
    assert report["measures"]["gcache"]["put_gbps"] == 4.0
    # against the machine, the same round's probe: 2/1, 4/4, 9/9
    vs = report["systems"]["gcache"]["vs"]
    assert vs["loopback_tcp_batch"]["put_gbps"] == pytest.approx([1.0, 1.0, 2.0])
    assert vs["python_tcp_pingpong"]["latency_p50_us"] == pytest.approx([0.2, 0.4, 0.6])
    assert report["fraction_of_limits_spread"]["put_of_loopback_tcp_batch"] == pytest.approx([1.0, 1.0, 2.0])
    assert list(report["systems"]) == ["gcache", "redis"] and "vs" not in report["systems"]["redis"]
    assert report["run_order"] == order
    assert report["limits_spread"]["loopback_tcp_batch_gbps"] == [1.0, 4.0, 9.0]
    target = next(t for t in report["targets"] if (t["measure"], t["against"]) == ("put_gbps", "redis"))
    assert target["ratio"] == pytest.approx(2.0) and target["spread"] == pytest.approx([1.0, 2.0, 3.0])
    assert target["met"] is True  # >= 2.0 on the median of the per-round ratios

    text = bench_report.render_table(report)
    lines = text.splitlines()
    assert "each round measures the machine, then runs each workload on gcache, redis in turn" in text
    assert any(
        line.split() == ["PUT", "from", "a", "caller's", "buffer", "(GB/s)", "median", "min", "max"] for line in lines
    )
    assert ["gcache", "4", "2", "9"] in [line.split() for line in lines]
    assert ["gcache", "/", "redis", "2", "1", "3"] in [line.split() for line in lines]
    assert "ratio 2 [1..3]" in text


def test_a_round_missing_on_one_side_is_left_out_of_the_ratio():
    peers = {
        "gcache": {"available": True, "workloads": workloads([2.0, 4.0, 9.0], [10.0, 20.0, 30.0])},
        "redis": {
            "available": True,
            "workloads": {"put": combine_repeats([dict(figures(1.0), round=0), dict(figures(3.0), round=2)])},
        },
    }
    report = bench_report.build(CONFIG, LIMITS, peers, {"exit_code": None})
    assert report["ratio_spread"]["redis"]["put_gbps"] == pytest.approx([2.0, 2.5, 3.0])
