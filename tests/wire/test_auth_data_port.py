"""Authentication and tenants on the data port (--auth-file): the challenge-response,
what an unauthenticated peer can do (PING only, then a deadline), tenant key namespaces,
roles, and the client's AuthError. Real gcache-server processes, raw sockets."""

from __future__ import annotations

import hashlib
import hmac
import os
import time

import pytest

import gcache
from gcache import errors
from gcache._native import hmac_sha256
from gcache.wire.auth import auth_mac, token_id
from tests.support.raw_protocol import (
    AUTH,
    EXISTS_BATCH,
    FORBIDDEN,
    GET_BATCH,
    KEY_INVALID,
    PING,
    REMOVE_BATCH,
    STATS,
    STORED,
    UNAUTHENTICATED,
    RawConnection,
    frame_bytes,
    put_frame,
    raw_auth,
)
from tests.support.servers import run_server_cli

ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789ab"
READER = "reader-secret-0123456789"
NODE = "node-secret-0123456789ab"

AUTH_FILE = f"""
[tenants.alice]
token = "{ALICE}"
roles = ["read", "write"]

[tenants.bob]
token = "{BOB}"
roles = ["read", "write"]

[tenants.reader]
token = "{READER}"
roles = ["read"]

[tenants.nodes]
token = "{NODE}"
roles = ["cluster"]
"""


@pytest.fixture
def auth_server(server_factory, tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(AUTH_FILE)
    path.chmod(0o600)
    return server_factory(extra_args=["--auth-file", str(path), "--auth-timeout-s", "2"])


def ping_until_closed(conn: RawConnection, pings_max: int) -> int:
    """PINGs every 0.1 s until the server closes; returns how many were answered."""
    for answered in range(pings_max):
        try:
            frame = conn.request(PING, {})
        except (ConnectionError, OSError):
            return answered
        assert frame.status == 0
        time.sleep(0.1)
    return pings_max


def test_native_hmac_matches_python():
    for key_len in (0, 1, 16, 63, 64, 65, 200):
        for msg_len in (0, 1, 55, 56, 63, 64, 65, 127, 128, 1000):
            key, msg = os.urandom(key_len), os.urandom(msg_len)
            assert hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


def test_unauthenticated_peer_gets_ping_only_then_is_closed(auth_server):
    conn = RawConnection(auth_server.port)
    pong = conn.request(PING, {})
    assert pong.status == 0 and pong.meta["map"] == b""  # no cluster map before AUTH
    for opcode, meta in ((GET_BATCH, {"keys": [b"k"]}), (STATS, {})):
        c = RawConnection(auth_server.port)
        refused = c.request(opcode, meta)
        assert refused.status == UNAUTHENTICATED and refused.meta["kind"] == "UNAUTHENTICATED"
        assert "GCACHE_TOKEN" in refused.meta["error"]
        assert c.sock.recv(1) == b""  # closed
        c.close()
    # The auth deadline (2 s here) closes a connection that only pings.
    assert ping_until_closed(conn, pings_max=200) < 200


def test_wrong_mac_or_replayed_answer_is_refused_and_closes(auth_server):
    conn = RawConnection(auth_server.port)
    nonce = conn.request(AUTH, {}).meta["nonce"]
    bad = conn.request(AUTH, {"id": token_id(ALICE), "mac": auth_mac("not-" + ALICE, nonce)})
    assert bad.status == UNAUTHENTICATED and "no tenant with that token" in bad.meta["error"]
    assert conn.sock.recv(1) == b""
    # An answer recorded on one connection is worthless on the next: a new nonce.
    first = RawConnection(auth_server.port)
    nonce1 = first.request(AUTH, {}).meta["nonce"]
    recorded = {"id": token_id(ALICE), "mac": auth_mac(ALICE, nonce1)}
    second = RawConnection(auth_server.port)
    nonce2 = second.request(AUTH, {}).meta["nonce"]
    assert nonce2 != nonce1
    assert second.request(AUTH, recorded).status == UNAUTHENTICATED
    # An answer without asking for a nonce first is refused too.
    third = RawConnection(auth_server.port)
    assert third.request(AUTH, recorded).status == UNAUTHENTICATED
    stats = raw_auth(RawConnection(auth_server.port), ALICE).request(STATS, {}).meta
    assert stats["counters"]["auth_failures"] == 3 and stats["counters"]["auth_successes"] == 1


def test_tenants_cannot_see_each_others_keys(auth_server):
    alice = raw_auth(RawConnection(auth_server.port), ALICE)
    bob = raw_auth(RawConnection(auth_server.port), BOB)
    assert alice.put([(b"shared-name", b"alice bytes")]) == [STORED]
    # Bob writing the same key first/afterwards stores his own value: no poisoning.
    assert bob.put([(b"shared-name", b"bob bytes")]) == [STORED]
    assert alice.get([b"shared-name"]) == [b"alice bytes"]
    assert bob.get([b"shared-name"]) == [b"bob bytes"]
    # Existence and removal stay within the tenant.
    assert alice.put([(b"only-alice", b"a")]) == [STORED]
    ex = bob.request(EXISTS_BATCH, {"keys": [b"only-alice", b"shared-name"]})
    assert ex.meta["ex"] == [False, True]
    rm = bob.request(REMOVE_BATCH, {"keys": [b"only-alice"]})
    assert rm.meta["st"] == [1]  # not found: it is not bob's
    assert alice.get([b"only-alice"]) == [b"a"]
    # Key bytes that imitate the prefix do not escape the namespace.
    assert bob.get([b"alice\x00only-alice"]) == [None]
    # A 512-byte key is fine for a tenant, 513 is KEY_INVALID as without auth.
    assert alice.put([(b"x" * 512, b"v"), (b"y" * 513, b"v")]) == [STORED, KEY_INVALID]


def test_roles_are_enforced_and_forbidden_keeps_the_connection(auth_server):
    alice = raw_auth(RawConnection(auth_server.port), ALICE)
    assert alice.put([(b"k", b"value")]) == [STORED]
    reader = raw_auth(RawConnection(auth_server.port), READER)
    reader.send(put_frame([(b"k2", b"x" * 1000)], request_id=99))
    refused = reader.recv_frame()
    assert refused.status == FORBIDDEN and "'write' role" in refused.meta["error"]
    refused = reader.request(REMOVE_BATCH, {"keys": [b"k"]})
    assert refused.status == FORBIDDEN
    assert reader.get([b"k"]) == [None]  # its own namespace is empty
    assert reader.request(PING, {}).status == 0  # still open
    # The cluster role reads raw (prefixed) keys: what rebalancing moves between nodes.
    node = raw_auth(RawConnection(auth_server.port), NODE)
    assert node.get([b"alice\x00k"]) == [b"value"]
    assert node.get([b"k"]) == [None]


def test_client_token_and_auth_errors(auth_server, monkeypatch):
    monkeypatch.delenv("GCACHE_TOKEN", raising=False)
    monkeypatch.delenv("GCACHE_TOKEN_FILE", raising=False)
    with gcache.Client(auth_server.address, token=ALICE) as c:
        assert c.put(b"k", b"v1") is True
        assert c.get(b"k") == b"v1"
        assert c.batch_exists_prefix([b"k", b"nope"]) == 1
    with gcache.Client(auth_server.address) as anonymous:
        with pytest.raises(errors.AuthError) as info:
            anonymous.get(b"k")
        assert info.value.kind == "unauthenticated" and "GCACHE_TOKEN" in str(info.value)
    with gcache.Client(auth_server.address, token="wrong-token-0123456789") as wrong:
        with pytest.raises(errors.AuthError, match="rejected the token"):
            wrong.put(b"k", b"x")
    with gcache.Client(auth_server.address, token=READER) as reader:
        with pytest.raises(errors.AuthError) as info:
            reader.put(b"k", b"x")
        assert info.value.kind == "forbidden"
        assert reader.get(b"k") is None
    monkeypatch.setenv("GCACHE_TOKEN", ALICE)
    with gcache.Client(auth_server.address) as from_env:
        assert from_env.get(b"k") == b"v1"


def test_client_with_token_works_against_a_node_without_auth(server):
    with gcache.Client(server.address, token=ALICE) as c:
        assert c.put(b"k", b"v") is True and c.get(b"k") == b"v"
    conn = RawConnection(server.port)
    assert conn.request(AUTH, {}).meta == {"auth": False}


@pytest.mark.process
def test_bad_auth_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "auth.toml"
    bad.write_text('[tenants.x]\ntoken = "short"\nroles = ["read"]\n')
    out = run_server_cli("--auth-file", str(bad), "--port", "0")
    assert out.returncode == 2 and "token must be a string of 16" in out.stderr


def test_tenant_connection_cap_leaves_other_tenants_served(server_factory, tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(AUTH_FILE)
    node = server_factory(extra_args=["--auth-file", str(path), "--connections-per-tenant-max", "3"])
    held = [raw_auth(RawConnection(node.port), ALICE) for _ in range(3)]
    extra = RawConnection(node.port)
    nonce = extra.request(AUTH, {}).meta["nonce"]
    refused = extra.request(AUTH, {"id": token_id(ALICE), "mac": auth_mac(ALICE, nonce)})
    assert refused.status == 5 and "--connections-per-tenant-max" in refused.meta["error"]  # BUSY
    assert extra.closed_by_server()
    bob = raw_auth(RawConnection(node.port), BOB)
    assert bob.put([(b"k", b"v")]) == [STORED]
    held[0].close()  # a slot frees up once one of alice's connections closes
    for _ in range(100):
        again = RawConnection(node.port)
        nonce = again.request(AUTH, {}).meta["nonce"]
        answer = again.request(AUTH, {"id": token_id(ALICE), "mac": auth_mac(ALICE, nonce)})
        if answer.status == 0:
            break
        time.sleep(0.05)
    assert answer.status == 0
    assert bob.stats()["counters"]["connections_refused_tenant"] >= 1


def test_unauthenticated_peer_cannot_stretch_the_auth_deadline_with_a_slow_frame(server_factory, tmp_path):
    """A header trickled a byte at a time is cut at the auth deadline (1 s here), long
    before its 32 bytes (0.3 s apart: ~10 s) or the 30 s stall timeout."""
    path = tmp_path / "auth.toml"
    path.write_text(AUTH_FILE)
    node = server_factory(extra_args=["--auth-file", str(path), "--auth-timeout-s", "1"])
    conn = RawConnection(node.port)
    header = frame_bytes(PING, {})[:32]
    sent = 0
    try:
        for sent in range(32):
            conn.sock.send(header[sent : sent + 1])
            time.sleep(0.3)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < 31, "the node kept reading a frame past the auth deadline"
    assert conn.closed_by_server()
