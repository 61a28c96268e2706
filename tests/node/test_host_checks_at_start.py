"""gcache-server runs the host checks at start (issue 21, finding 7): one warning line per
setting that warns, with its fix, and every check's result as a gauge in /metrics."""

from __future__ import annotations

import urllib.request

from gcache.common.host_checks import CHECKS


def test_the_node_logs_host_warnings_and_exports_every_check_as_a_gauge(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("gcache_host_check_"):
            name, value = line.split()
            values[name.removeprefix("gcache_host_check_")] = int(value)
    assert set(values) == {c.__name__.removeprefix("check_") for c in CHECKS}
    assert set(values.values()) <= {1, 0, -1}
    log = server.log()
    for name, value in values.items():  # a warning is logged exactly where the gauge says so
        assert (f"host check {name}: " in log) == (value == 0), (name, value)
