"""/metrics is valid Prometheus text (every line checked) and histograms carry `_sum`."""

from __future__ import annotations

import math
import os
import re
import urllib.request

from gcache.server.prometheus import render
from tests.support.raw_protocol import STORED, RawConnection

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"'
_SAMPLE = re.compile(rf"^({_NAME})(\{{{_LABEL}(?:,{_LABEL})*\}})? (\S+)$")
_TYPE = re.compile(rf"^# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)$")
_HELP = re.compile(rf"^# HELP ({_NAME}) .*$")


def _float(text: str) -> float:
    value = float(text)  # Prometheus accepts Go float syntax, which includes Python's
    assert not math.isnan(value), text
    return value


def parse_exposition(text: str) -> dict[str, dict]:
    """Checks every line of text format 0.0.4; returns {family: {"type", "samples": [(name, labels, value)]}}."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    families: dict[str, dict] = {}
    current = None
    seen_samples = set()
    for line in text.splitlines():
        assert line, "no blank lines"
        if line.startswith("#"):
            typed = _TYPE.match(line)
            if typed:
                name, kind = typed.groups()
                assert name not in families, f"family {name} declared twice"
                families[name] = {"type": kind, "samples": []}
                current = name
            else:
                assert _HELP.match(line), f"bad comment line {line!r}"
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", _float(m.group(3))
        assert current is not None, f"sample before any # TYPE: {line!r}"
        kind = families[current]["type"]
        allowed = {current} if kind != "histogram" else {current + s for s in ("_bucket", "_sum", "_count")}
        assert name in allowed, f"{name} is not part of family {current} (samples must be grouped)"
        assert (name, labels) not in seen_samples, f"duplicate sample {line!r}"
        seen_samples.add((name, labels))
        families[current]["samples"].append((name, labels, value))
    for family, info in families.items():
        samples = info["samples"]
        assert samples, f"family {family} has no samples"
        if info["type"] == "counter":
            assert family.endswith("_total") and all(v >= 0 for _, _, v in samples)
        if info["type"] == "histogram":
            check_histogram(family, samples)
    return families


def check_histogram(family: str, samples: list) -> None:
    buckets = [(labels, v) for n, labels, v in samples if n == family + "_bucket"]
    sums = [v for n, _, v in samples if n == family + "_sum"]
    counts = [v for n, _, v in samples if n == family + "_count"]
    assert len(sums) == 1 and len(counts) == 1, f"{family} needs exactly one _sum and one _count"
    bounds = [_float(re.fullmatch(r'\{le="([^"]+)"\}', labels).group(1)) for labels, _ in buckets]
    assert bounds[-1] == math.inf, f'{family}: the last bucket must be le="+Inf"'
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), f"{family}: le not increasing"
    values = [v for _, v in buckets]
    assert values == sorted(values), f"{family}: buckets are not cumulative"
    assert values[-1] == counts[0], f"{family}: +Inf bucket != _count"
    assert sums[0] >= 0


def admin_metrics(node) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def sum_bounds_us(buckets: list[int]) -> tuple[int, float]:
    """The [low, high) range a latency sum must lie in, given the bucket counts."""
    low = sum(count << i for i, count in enumerate(buckets) if i > 0)
    high = math.inf if buckets[-1] else sum(count << (i + 1) for i, count in enumerate(buckets))
    return low, high


def test_histogram_sums_agree_with_buckets_and_reach_metrics(server):
    with RawConnection(server.port) as c:
        for _ in range(20):
            c.ping()
        assert c.put([(b"big", os.urandom(8 << 20))]) == [STORED]  # surely >= 1 us
        stats = c.stats()
    sums_us = stats["histogram_sums_us"]
    assert set(sums_us) == set(stats["histograms"])
    for name, buckets in stats["histograms"].items():
        low, high = sum_bounds_us(buckets)
        assert low <= sums_us[name] < high or (sum(buckets) == 0 and sums_us[name] == 0), name
    assert sums_us["put_batch"] >= 1 and sum(stats["histograms"]["ping"]) == 20

    families = parse_exposition(admin_metrics(server))  # no data requests since STATS above
    ping = dict(((n, l), v) for n, l, v in families["gcache_ping_latency_seconds"]["samples"])
    assert ping[("gcache_ping_latency_seconds_sum", "")] == sums_us["ping"] / 1e6
    assert ping[("gcache_ping_latency_seconds_count", "")] == 20
    put = dict(((n, l), v) for n, l, v in families["gcache_put_batch_latency_seconds"]["samples"])
    assert put[("gcache_put_batch_latency_seconds_sum", "")] == sums_us["put_batch"] / 1e6 > 0
    assert families["gcache_disk_copy_forwards_total"]["type"] == "counter"


def test_render_prints_exact_sum_in_seconds_without_exponents():
    buckets = [0] * 32
    buckets[1], buckets[20] = 3, 1
    text = render({"histograms": {"get_batch": buckets}, "histogram_sums_us": {"get_batch": 1_048_583}})
    families = parse_exposition(text)
    samples = families["gcache_get_batch_latency_seconds"]["samples"]
    assert ("gcache_get_batch_latency_seconds_sum", "", 1.048583) in samples
    assert "gcache_get_batch_latency_seconds_sum 1.048583" in text.splitlines()
    tiny = render({"histograms": {"ping": [1] + [0] * 31}, "histogram_sums_us": {"ping": 1}})
    assert "gcache_ping_latency_seconds_sum 0.000001" in tiny.splitlines()
