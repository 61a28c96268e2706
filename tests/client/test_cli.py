"""The `gcache` operator CLI, run as a subprocess against a real server."""

import json
import socket
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.process  # starts processes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module; every test uses its own keys."""
    node = ServerProcess(tmp_path_factory.mktemp("cli") / "data").start()
    yield node
    node.kill()


def gcache(server_address, *args, stdin: bytes = b""):
    return subprocess.run(
        [sys.executable, "-m", "gcache.cli.main", "--server", server_address, *args],
        input=stdin,
        capture_output=True,
        cwd=REPO_ROOT,
        timeout=60,
    )


def test_put_get_round_trip_through_files(server, tmp_path):
    value = bytes(range(256)) * 40
    (tmp_path / "in.bin").write_bytes(value)
    put = gcache(server.address, "put", "page-1", str(tmp_path / "in.bin"))
    assert put.returncode == 0, put.stderr
    got = gcache(server.address, "get", "page-1", "-o", str(tmp_path / "out.bin"))
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "out.bin").read_bytes() == value


def test_put_from_stdin_get_to_stdout(server):
    assert gcache(server.address, "put", "stdin-k", "-", stdin=b"\x00hello\xff").returncode == 0
    got = gcache(server.address, "get", "stdin-k")
    assert got.returncode == 0 and got.stdout == b"\x00hello\xff"


def test_get_miss_exits_1(server):
    got = gcache(server.address, "get", "absent")
    assert got.returncode == 1
    assert got.stdout == b"" and b"miss" in got.stderr


def test_exists_and_rm(server):
    gcache(server.address, "put", "a", "-", stdin=b"1")
    exists = gcache(server.address, "exists", "a", "b")
    assert exists.returncode == 1
    assert exists.stdout.decode().splitlines() == ["1\ta", "0\tb"]
    assert gcache(server.address, "exists", "a").returncode == 0
    rm = gcache(server.address, "rm", "a", "b")
    assert rm.returncode == 0
    assert rm.stdout.decode().splitlines() == ["removed\ta", "absent\tb"]
    assert gcache(server.address, "exists", "a").returncode == 1


def test_hex_keys(server):
    assert gcache(server.address, "--hex-keys", "put", "00ff", "-", stdin=b"x").returncode == 0
    assert gcache(server.address, "--hex-keys", "get", "00ff").stdout == b"x"
    assert gcache(server.address, "--hex-keys", "get", "zz").returncode == 2


def test_stats_json_and_table(server):
    gcache(server.address, "put", "stats-k", "-", stdin=b"v")
    as_json = gcache(server.address, "stats", "--json")
    assert as_json.returncode == 0, as_json.stderr
    stats = json.loads(as_json.stdout)
    assert set(stats) >= {"counters", "gauges", "histograms"}
    table = gcache(server.address, "stats")
    assert table.returncode == 0 and b"counters:" in table.stdout


def test_ping(server):
    ping = gcache(server.address, "ping")
    assert ping.returncode == 0, ping.stderr
    assert server.address.encode() in ping.stdout and b"version" in ping.stdout


def test_unreachable_server_exits_4():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    ping = gcache(address, "ping")
    assert ping.returncode == 4
    assert b"refused" in ping.stderr


def test_invalid_key_exits_2(server):
    got = gcache(server.address, "get", "k" * 513)
    assert got.returncode == 2 and b"512" in got.stderr


def test_help_documents_exit_codes():
    out = subprocess.run(
        [sys.executable, "-m", "gcache.cli.main", "--help"], capture_output=True, cwd=REPO_ROOT, timeout=60
    )
    assert out.returncode == 0
    assert b"exit codes" in out.stdout and b"not admitted" in out.stdout
