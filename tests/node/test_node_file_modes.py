"""What a real gcache-server writes, only its own user may read, whatever the umask it was
started with (issue 21, finding 2); a data dir or an auth file others could read or write is
refused at start (exit 2, with the fix); a node creates its data dir, so its Unix socket
exists on a fresh start even with --disk 0 (finding 3)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import gcache
from gcache.client.transports import choose
from gcache.common.processes import free_port
from tests.support import REPO_ROOT, waiting
from tests.support.servers import ServerProcess, run_server_cli

pytestmark = pytest.mark.process

TOKEN = "alice-secret-0123456789"
AUTH_FILE = f'[tenants.alice]\ntoken = "{TOKEN}"\nroles = ["read", "write"]\n'


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the systemd default; the server inherits it
    yield
    os.umask(old)


def modes_under(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def test_every_file_the_node_writes_is_private_under_umask_022(tmp_path, umask_022):
    data = tmp_path / "node"
    node = ServerProcess(data, memory="8MiB", disk="64MiB", extra_args=["--segment-bytes", "1MiB"]).start()
    try:
        assert stat.S_IMODE(os.stat(data / "gcache.sock").st_mode) == 0o600
        with gcache.Client(node.address, transport="tcp") as client:
            for n in range(64):  # 16 MiB through an 8 MiB memory tier: segments on disk
                assert client.put(f"k{n}".encode(), bytes([n]) * (256 << 10))
        assert node.stop() == 0  # graceful: the memory tier and warm.list are written
    finally:
        node.kill()
    modes = modes_under(data)
    assert modes.pop(".") == 0o700
    assert sum(name.startswith("seg-") for name in modes) >= 2, modes
    assert "warm.list" in modes, modes
    exposed = {name: f"{mode:04o}" for name, mode in modes.items() if mode & 0o077}
    assert exposed == {}


def start_args(data_dir: Path, *extra: str) -> list[str]:
    return ["--port", "0", "--admin-port", "0", "--memory", "8MiB", "--disk", "0", "--data-dir", str(data_dir), *extra]


def test_a_data_dir_others_can_read_is_refused_with_the_chmod(tmp_path):
    data = tmp_path / "shared"
    data.mkdir()
    data.chmod(0o755)
    done = run_server_cli(*start_args(data))
    assert done.returncode == 2, done.stderr
    assert f"--data-dir {data} is mode 0755: other users can read" in done.stderr
    assert f"chmod 700 {data}" in done.stderr


@pytest.mark.parametrize(("mode", "exit_code"), [(0o620, 2), (0o602, 2)])
def test_a_writable_auth_file_is_refused(tmp_path, mode, exit_code):
    auth = tmp_path / "auth.toml"
    auth.write_text(AUTH_FILE)
    auth.chmod(mode)
    done = run_server_cli(*start_args(tmp_path / "data", "--auth-file", str(auth)))
    assert done.returncode == exit_code, done.stderr
    assert "who could add a tenant" in done.stderr and f"chmod 600 {auth}" in done.stderr


def test_an_auth_file_of_another_user_is_refused(tmp_path):
    auth = tmp_path / "auth.toml"
    auth.write_text(AUTH_FILE)
    auth.chmod(0o600)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    os.chown(auth, 4243, -1)
    done = run_server_cli(*start_args(tmp_path / "data", "--auth-file", str(auth)))
    assert done.returncode == 2, done.stderr
    assert "is owned by uid 4243, neither this user (0) nor root" in done.stderr


def test_the_master_refuses_a_writable_auth_file(tmp_path):
    auth = tmp_path / "auth.toml"
    auth.write_text(AUTH_FILE)
    auth.chmod(0o666)
    grpc, raft = free_port(), free_port()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gcache.master.main",
            *("--grpc", f"127.0.0.1:{grpc}", "--raft", f"127.0.0.1:{raft}", "--data-dir", str(tmp_path / "m")),
            *("--auth-file", str(auth)),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "writable by group and others" in done.stderr


def test_memory_only_node_creates_its_data_dir_so_same_host_clients_get_shared_memory(tmp_path, umask_022, caplog):
    """--disk 0 --data-dir DIR with DIR missing: the node creates DIR 0700 and its socket."""
    fresh = tmp_path / "fresh" / "dir"
    node = ServerProcess(tmp_path / "launcher", disk="0", extra_args=["--data-dir", str(fresh)]).start()
    try:
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
        assert (fresh / "gcache.sock").is_socket()
        with gcache.Client(node.address, transport="auto") as client:
            assert client.transport == "shm"
            assert client.put(b"k", b"v") and client.get(b"k") == b"v"
    finally:
        node.kill()


def test_a_node_without_a_unix_socket_says_so_and_auto_says_why_it_chose_tcp(tmp_path, caplog, monkeypatch):
    # The "said once" memory is per process: an earlier test's node on the same (reused) port
    # would already be in it.
    monkeypatch.setattr(choose, "_tcp_logged", set())
    node = ServerProcess(tmp_path / "node", disk="0", extra_args=["--unix-socket", ""]).start()
    try:
        waiting.wait_until(lambda: "no shared memory for same-host clients" in node.log(), timeout_s=30)
        assert "--unix-socket '' turns the Unix socket off" in node.log()
        caplog.set_level(logging.INFO, logger="gcache")
        for _ in range(2):
            with gcache.Client(node.address, transport="auto") as client:
                assert client.transport == "tcp"
        why = [r.getMessage() for r in caplog.records if "chose TCP" in r.getMessage()]
        assert len(why) == 1, why  # once per process and node, not per client
        assert f"transport 'auto' chose TCP for {node.address} (shm: " in why[0]
        assert "offers no Unix socket" in why[0]
    finally:
        node.kill()
