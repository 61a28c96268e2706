"""gcache-server as a process: exit codes, graceful stop + warm restart, kill -9
recovery, on-disk corruption, admin endpoints."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import urllib.request

import pytest

from gcache.common.processes import free_port
from tests.support.raw_protocol import STORED, RawConnection, put_frame
from tests.support.servers import run_server_cli

pytestmark = pytest.mark.process  # starts processes


def admin_get(node, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def admin_flush(node) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{node.admin_port}/flush", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def make_items(prefix: str, count: int, size: int) -> dict[bytes, bytes]:
    return {f"{prefix}-{i}".encode(): os.urandom(size) for i in range(count)}


def put_all(port: int, items: dict[bytes, bytes]) -> None:
    with RawConnection(port) as c:
        pairs = list(items.items())
        for i in range(0, len(pairs), 16):
            assert c.put(pairs[i : i + 16]) == [STORED] * len(pairs[i : i + 16])


def test_bad_flag_exits_2():
    result = run_server_cli("--no-such-flag")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr
    result = run_server_cli("--memory", "lots")
    assert result.returncode == 2 and "size 'lots' is not understood" in result.stderr
    result = run_server_cli("--spin-us", "20000")
    assert result.returncode == 2 and "--spin-us must be in [0, 10000]" in result.stderr


def test_bad_config_file_exits_2(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('memory = "1GiB"\nno_such_key = 1\n')
    result = run_server_cli("--config", str(config))
    assert result.returncode == 2 and "no_such_key" in result.stderr


def test_port_in_use_exits_3(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_server_cli(
            "--port",
            str(port),
            "--admin-port",
            "0",
            "--memory",
            "16MiB",
            "--disk",
            "16MiB",
            "--data-dir",
            str(tmp_path / "d"),
        )
    assert result.returncode == 3, result.stderr
    assert "Address already in use" in result.stderr and str(port) in result.stderr


def test_admin_port_in_use_exits_3(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_server_cli(
            "--port",
            str(free_port()),
            "--admin-port",
            str(port),
            "--memory",
            "16MiB",
            "--disk",
            "16MiB",
            "--data-dir",
            str(tmp_path / "d"),
        )
    assert result.returncode == 3, result.stderr
    assert str(port) in result.stderr


def test_data_dir_in_use_exits_3(server_factory):
    first = server_factory("shared")
    result = run_server_cli(
        "--port",
        str(free_port()),
        "--admin-port",
        "0",
        "--memory",
        "16MiB",
        "--disk",
        "16MiB",
        "--data-dir",
        str(first.data_dir),
        timeout_s=20,
    )
    assert result.returncode == 3, result.stderr
    assert first.alive()


def test_start_logs_effective_config(server):
    server.stop()
    assert re.search(r'config \{.*"memory": 67108864', server.log())


def test_sigterm_exits_0_and_restart_is_warm(server_factory):
    node = server_factory("warm")
    items = make_items("warm", 40, 64 << 10)
    put_all(node.port, items)
    assert node.stop(signal.SIGTERM) == 0
    assert "stopped cleanly" in node.log()
    again = server_factory("warm")  # same data dir
    with RawConnection(again.port) as c:
        keys = list(items)
        assert c.get(keys) == [items[k] for k in keys]
        counters = c.stats()["counters"]
    assert counters["misses"] == 0


def test_sigint_also_stops_cleanly(server):
    put_all(server.port, make_items("int", 3, 100))
    assert server.stop(signal.SIGINT) == 0


def test_kill_9_keeps_everything_that_reached_disk(server_factory):
    node = server_factory("crash")
    flushed = make_items("flushed", 30, 32 << 10)
    put_all(node.port, flushed)
    admin_flush(node)  # these are on disk now
    unflushed = make_items("late", 10, 32 << 10)
    put_all(node.port, unflushed)
    node.proc.kill()
    node.proc.wait(timeout=10)
    again = server_factory("crash")
    with RawConnection(again.port) as c:
        keys = list(flushed)
        assert c.get(keys) == [flushed[k] for k in keys]
        late_keys = list(unflushed)
        for key, got in zip(late_keys, c.get(late_keys)):
            assert got is None or got == unflushed[key], "never wrong bytes"


def test_corrupted_disk_record_is_a_miss_never_wrong_bytes(server_factory):
    node = server_factory("corrupt")
    marker = os.urandom(8)
    value = marker * (4096 // 8)
    other = os.urandom(4096)
    put_all(node.port, {b"victim": value, b"bystander": other})
    assert node.stop(signal.SIGTERM) == 0
    segments = sorted(node.data_dir.rglob("seg-*.log"))
    assert segments, f"no seg-*.log files in {node.data_dir}"
    flipped = 0
    for seg in segments:
        data = bytearray(seg.read_bytes())
        at = data.find(value)
        if at >= 0:
            data[at + 2000] ^= 0xFF
            seg.write_bytes(bytes(data))
            flipped += 1
    assert flipped == 1, "the value should be on disk exactly once"
    again = server_factory("corrupt")
    with RawConnection(again.port) as c:
        assert c.get([b"victim", b"bystander"]) == [None, other]
        assert c.get([b"victim"]) == [None]
        assert c.stats()["counters"]["checksum_failures"] >= 1


_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"\})? -?[0-9.e+]+$')


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        assert _SAMPLE.match(line), f"not Prometheus text: {line!r}"
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def test_admin_metrics_parse_and_move(server):
    status, text = admin_get(server, "/metrics")
    assert status == 200
    before = parse_metrics(text)
    assert before["gcache_requests_total"] >= 0
    assert before['gcache_ping_latency_seconds_bucket{le="+Inf"}'] == before["gcache_ping_latency_seconds_count"]
    with RawConnection(server.port) as c:
        c.ping()
        c.put([(b"m", b"value")])
        c.get([b"m", b"nope"])
    after = parse_metrics(admin_get(server, "/metrics")[1])
    assert after["gcache_requests_total"] == before["gcache_requests_total"] + 3
    assert after["gcache_puts_stored_total"] == before["gcache_puts_stored_total"] + 1
    assert after["gcache_misses_total"] == before["gcache_misses_total"] + 1
    assert after["gcache_ping_latency_seconds_count"] == before["gcache_ping_latency_seconds_count"] + 1
    buckets = [v for k, v in after.items() if k.startswith("gcache_get_batch_latency_seconds_bucket")]
    assert len(buckets) == 32 and buckets == sorted(buckets)  # cumulative


def test_admin_health_endpoints(server):
    assert admin_get(server, "/healthz") == (200, "ok\n")
    assert admin_get(server, "/readyz") == (200, "ready\n")
    assert admin_get(server, "/nope")[0] == 404


def test_sigterm_lets_a_request_in_flight_finish(server_factory):
    # A grace far above any scheduling stall: on a loaded machine the test itself can be starved
    # for seconds between the SIGTERM and its last bytes; what is checked is that the request
    # finishes, not how fast.
    node = server_factory("inflight", extra_args=("--shutdown-grace-s", "120"))
    value = os.urandom(256 << 10)
    idle = RawConnection(node.port)
    assert idle.ping()
    with RawConnection(node.port) as c:
        frame = put_frame([(b"inflight", value)], request_id=41)
        c.send(frame[:-1000])  # mid-payload
        node.proc.send_signal(signal.SIGTERM)
        for _ in range(400):  # bounded wait until shutdown has begun
            if admin_get(node, "/readyz")[0] == 503:
                break
            time.sleep(0.025)
        assert admin_get(node, "/readyz") == (503, "shutting down\n")
        c.send(frame[-1000:])
        reply = c.recv_frame()
        assert reply.request_id == 41 and reply.meta["st"] == [STORED]
        assert c.closed_by_server()
    assert idle.closed_by_server()  # idle connections are closed, not waited for
    idle.close()
    assert node.stop() == 0
    again = server_factory("inflight")
    with RawConnection(again.port) as c:
        assert c.get([b"inflight"]) == [value]
