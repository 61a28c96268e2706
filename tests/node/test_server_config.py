"""gcache-server flags, sizes and config-file merging (gcache/server/config.py)."""

from __future__ import annotations

import pytest

from gcache.server.config import ConfigError, load_settings, parse_size
from gcache.server.prometheus import render


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4096", 4096),
        ("0", 0),
        ("64MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("500MB", 500 * 10**6),
        ("2kb", 2000),
        ("7 KiB", 7 << 10),
        (123, 123),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "12XB", "-1MiB", "1e9", -5, True])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_defaults_match_protocol_limits():
    s = load_settings([])
    assert (s.port, s.value_bytes_max, s.batch_keys_max, s.connections_max) == (7600, 64 << 20, 16384, 1024)
    assert (s.idle_timeout_s, s.stall_timeout_s, s.frame_payload_bytes_max) == (300, 30, 2 << 30)


def test_config_file_dashes_or_underscores_and_cli_wins(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('memory = "2GiB"\ndata_dir = "/x"\nidle-timeout-s = 5\nwarm-restart = false\n')
    s = load_settings(["--config", str(path), "--memory", "3GiB"])
    assert (s.memory, s.data_dir, s.idle_timeout_s, s.warm_restart) == (3 << 30, "/x", 5.0, False)


@pytest.mark.parametrize(
    "toml,message",
    [
        ('port = "seven"\n', "port must be an integer"),
        ("warm-restart = 1\n", "true or false"),
        ('memory = "1KiB"\n', "--memory must be at least 1MiB"),
        ("port = 70000\n", "--port must be 0..65535"),
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("memory = \n", "not valid TOML"),
    ],
)
def test_bad_config_values_say_what_is_wrong(tmp_path, toml, message):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_settings(["--config", str(path)])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(["--config", str(tmp_path / "none.toml")])


def test_prometheus_histogram_is_cumulative_with_inf():
    buckets = [0] * 32
    buckets[0], buckets[3], buckets[31] = 2, 5, 1
    text = render({"counters": {"requests": 9}, "gauges": {"keys_memory": -1}, "histograms": {"ping": buckets}})
    lines = text.splitlines()
    assert "gcache_requests_total 9" in lines and "gcache_keys_memory -1" in lines
    assert 'gcache_ping_latency_seconds_bucket{le="2e-06"} 2' in lines
    assert 'gcache_ping_latency_seconds_bucket{le="1.6e-05"} 7' in lines
    assert 'gcache_ping_latency_seconds_bucket{le="+Inf"} 8' in lines
    assert "gcache_ping_latency_seconds_count 8" in lines
    assert sum(1 for l in lines if l.startswith("gcache_ping_latency_seconds_bucket")) == 32
