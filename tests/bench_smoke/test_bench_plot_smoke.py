"""gcache-bench --plot: a report (as --json prints it) drawn to a PNG, also from a saved file."""

import json

import pytest

from gcache.tools.storebench import main as bench_main
from gcache.tools.storebench.plot import bars_for


def runs(*values):
    return {"runs": [{"gbps": v, "p50_us": v, "p99_us": v} for v in values], "gbps": sorted(values)[1]}


REPORT = {
    "config": {"batch": 64, "value_size": 256 << 10, "workers": 1, "mode": "threads", "repeat": 3},
    "limits": {"memcpy_batch_gbps": 12.0, "memcpy_put_gbps": 10.0, "loopback_tcp_put_gbps": 5.0},
    "peers": {
        "gcache": {"available": True, "workloads": {"put": runs(3, 4, 5)}},
        "redis": {"available": True, "workloads": {"put": runs(1, 1.5, 2), "get": runs(2, 2.5, 3)}},
        "mooncake": {"available": False, "reason": "not installed"},
    },
    "transports": {
        "by_transport": {
            "tcp": {"available": True, "spread": {"put_gbps": [3, 4, 5], "get_gbps": [4, 5, 6]}},
            "shm": {"available": True, "spread": {"put_gbps": [6, 7, 9], "get_gbps": [8, 9, 10]}},
            "rdma": {"available": False, "reason": "no device"},
        }
    },
}


def test_bars_are_transports_then_available_peers():
    assert bars_for(REPORT, "put_gbps") == [
        ("gcache tcp", [3, 4, 5]),
        ("gcache shm", [6, 7, 9]),
        ("redis", [1, 1.5, 2]),
    ]


@pytest.mark.process  # matplotlib may run fc-list for its font cache
def test_plot_from_a_saved_report(tmp_path):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(REPORT))
    png = tmp_path / "bench.png"
    assert bench_main.main(["--from-json", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
