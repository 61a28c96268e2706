"""Admin endpoints of a node with --auth-file: POST /flush and /drain need an admin bearer
token (401 / 403 otherwise), GET /metrics and the health endpoints stay open and never
show key names; the admin gRPC Flush needs the same token. The CLI passes a token file."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import msgpack
import pytest

import gcache
from gcache.common.processes import free_port

ADMIN = "admin-secret-0123456789"
WRITER = "writer-secret-0123456789"
SECRET_KEY = b"tenant-secret-key-name-7f3a"

AUTH_FILE = f"""
[tenants.ops]
token = "{ADMIN}"
roles = ["admin"]

[tenants.app]
token = "{WRITER}"
roles = ["read", "write"]
"""


@pytest.fixture
def node(server_factory, tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(AUTH_FILE)
    path.chmod(0o600)
    grpc_port = free_port()
    server = server_factory(extra_args=["--auth-file", str(path), "--grpc-port", str(grpc_port)])
    server.grpc_port = grpc_port
    return server


def http(node, method: str, path: str, token: str | None = None) -> tuple[int, str, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{node.admin_port}{path}", method=method, data=b"" if method == "POST" else None
    )
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def test_state_changes_need_an_admin_token(node):
    code, body, headers = http(node, "POST", "/flush")
    assert code == 401 and "Authorization: Bearer" in body and headers["WWW-Authenticate"].startswith("Bearer")
    code, body, _ = http(node, "POST", "/flush", token="no-such-token-0123456789")
    assert code == 401
    code, body, _ = http(node, "POST", "/flush", token=WRITER)
    assert code == 403 and "'app' lacks the admin role" in body
    code, body, _ = http(node, "POST", "/drain", token=WRITER)
    assert code == 403
    assert http(node, "POST", "/flush", token=ADMIN)[:2] == (200, "flushed\n")
    code, body, _ = http(node, "POST", "/drain", token=ADMIN)
    assert code == 409  # standalone: authorized, nothing to drain into


def test_metrics_and_health_stay_open_without_key_names(node):
    with gcache.Client(node.address, token=WRITER) as c:
        assert c.put(SECRET_KEY, b"v") is True
        assert c.get(SECRET_KEY) == b"v"
        assert c.get(SECRET_KEY + b"-missing") is None
    for path in ("/metrics", "/healthz", "/readyz", "/cluster"):
        code, body, _ = http(node, "GET", path)
        assert code == 200, path
        assert SECRET_KEY.decode() not in body, path
    code, body, _ = http(node, "GET", "/metrics")
    assert "\ngcache_auth_successes_total 1\n" in body and "\ngcache_hits_memory_total 1\n" in body


def grpc_call(port: int, method: str, token: str | None):
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = channel.unary_unary(
            f"/gcache.Admin/{method}", request_serializer=msgpack.packb, response_deserializer=msgpack.unpackb
        )
        return stub({}, timeout=30, metadata=metadata)


def test_admin_grpc_flush_needs_an_admin_token(node):
    assert isinstance(grpc_call(node.grpc_port, "Ping", None)["version"], str)
    assert "counters" in grpc_call(node.grpc_port, "Stats", None)
    with pytest.raises(grpc.RpcError) as info:
        grpc_call(node.grpc_port, "Flush", None)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        grpc_call(node.grpc_port, "Flush", WRITER)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert grpc_call(node.grpc_port, "Flush", ADMIN) == {"flushed": True}


def test_cli_passes_the_token(node, tmp_path, monkeypatch):
    monkeypatch.delenv("GCACHE_TOKEN", raising=False)
    monkeypatch.delenv("GCACHE_TOKEN_FILE", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(WRITER + "\n")
    value = tmp_path / "value"
    value.write_bytes(b"cli bytes")

    def cli(*args, env=None):
        return subprocess.run(
            [sys.executable, "-m", "gcache.cli.main", "--server", node.address, *args],
            capture_output=True,
            timeout=60,
            env=env,
        )

    assert cli("--token-file", str(token_file), "put", "k", str(value)).returncode == 0
    got = cli("--token-file", str(token_file), "get", "k")
    assert got.returncode == 0 and got.stdout == b"cli bytes"
    refused = cli("get", "k")
    assert refused.returncode == 6 and b"GCACHE_TOKEN" in refused.stderr
    import os

    env = dict(os.environ, GCACHE_TOKEN=WRITER)
    assert cli("get", "k", env=env).stdout == b"cli bytes"
