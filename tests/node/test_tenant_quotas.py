"""Per-tenant quotas (--auth-file `memory` / `disk`): a tenant over its memory quota
evicts only its own coldest values, `disk = "0"` keeps its values off disk, a disk
quota drops its evicted values once full, and /metrics shows each tenant's usage.
Real gcache-server processes, real auth files, real disk segment files."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

import gcache
from gcache.server.config import ConfigError, load_settings

KIB = 1024
VALUE = 16 * KIB
ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789ab"
CAROL = "carol-secret-0123456789"

AUTH_FILE = f"""
[tenants.alice]
token = "{ALICE}"
roles = ["read", "write"]
memory = "256KiB"
disk = "0"

[tenants.bob]
token = "{BOB}"
roles = ["read", "write"]

[tenants.carol]
token = "{CAROL}"
roles = ["read", "write"]
memory = "128KiB"
disk = "256KiB"
"""


def write_auth_file(tmp_path: Path) -> Path:
    path = tmp_path / "auth.toml"
    path.write_text(AUTH_FILE)
    path.chmod(0o600)
    return path


@pytest.fixture(params=["chain", "lru"])
def node(request, server_factory, tmp_path):
    path = write_auth_file(tmp_path)
    return server_factory(
        memory="64MiB", disk="64MiB", extra_args=["--auth-file", str(path), "--eviction-policy", request.param]
    )


def metrics(node) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/metrics", timeout=30) as response:
        return response.read().decode()


def put_one_by_one(client, values: dict[bytes, bytes]) -> None:
    for key, value in values.items():  # one request each: oldest first, in this order
        assert client.put(key, value) is True


def disk_file_bytes(data_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(Path(data_dir).rglob("*")) if p.is_file())


def gauge(body: str, field: str, tenant: str) -> int:
    prefix = f'gcache_tenant_{field}{{tenant="{tenant}"}} '
    lines = [line for line in body.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (field, tenant, body)
    return int(lines[0][len(prefix) :])


def test_a_tenant_over_its_memory_quota_evicts_only_its_own_oldest_values(node):
    bob_values = {b"b-%03d" % i: os.urandom(VALUE) for i in range(20)}
    alice_values = {b"a-%03d" % i: os.urandom(VALUE) for i in range(40)}
    with gcache.Client(node.address, token=BOB) as bob, gcache.Client(node.address, token=ALICE) as alice:
        put_one_by_one(bob, bob_values)
        put_one_by_one(alice, alice_values)
        # Alice's quota holds 16 of her 16 KiB values: her 24 oldest are gone (disk "0":
        # dropped, not demoted), her 16 newest read back exactly; Bob lost nothing.
        body = metrics(node)
        assert gauge(body, "memory_bytes", "alice") == 16 * VALUE
        assert gauge(body, "memory_quota_bytes", "alice") == 256 * KIB
        assert gauge(body, "disk_bytes", "alice") == 0
        assert gauge(body, "disk_off", "alice") == 1
        assert gauge(body, "disk_refusals", "alice") == 24
        assert gauge(body, "memory_bytes", "bob") == 20 * VALUE
        assert gauge(body, "memory_quota_bytes", "bob") == 0
        assert b"a-0" not in body.encode() and b"b-0" not in body.encode()  # no key names
        keys = list(alice_values)
        assert alice.get_batch(keys[24:]) == [alice_values[k] for k in keys[24:]]
        assert alice.get_batch(keys[:24]) == [None] * 24
        assert bob.get_batch(list(bob_values)) == list(bob_values.values())
        assert bob.stats()["counters"]["evictions_memory"] == 24
    # Alice's values never reached a disk file (a warm shutdown flushes memory to disk).
    assert node.stop() == 0
    on_disk = disk_file_bytes(node.data_dir)
    assert all(v[:64] not in on_disk for v in alice_values.values())
    assert all(v[:64] in on_disk for v in bob_values.values())


def test_a_disk_quota_drops_evicted_values_once_full(node):
    carol_values = {b"c-%03d" % i: os.urandom(VALUE) for i in range(40)}
    bob_values = {b"b-%03d" % i: os.urandom(VALUE) for i in range(4)}
    with gcache.Client(node.address, token=BOB) as bob, gcache.Client(node.address, token=CAROL) as carol:
        put_one_by_one(bob, bob_values)
        put_one_by_one(carol, carol_values)
        # Memory quota 8 values, disk quota 16: the 16 oldest were demoted to disk,
        # the next 16 were dropped (disk quota full), the 8 newest are in memory.
        body = metrics(node)
        assert gauge(body, "memory_bytes", "carol") == 8 * VALUE
        assert gauge(body, "disk_bytes", "carol") == 16 * VALUE
        assert gauge(body, "disk_quota_bytes", "carol") == 256 * KIB
        assert gauge(body, "disk_refusals", "carol") == 16
        assert gauge(body, "quota_evictions", "carol") == 32
        keys = list(carol_values)
        assert carol.get_batch(keys[32:]) == [carol_values[k] for k in keys[32:]]
        assert carol.get_batch(keys[16:32]) == [None] * 16
        for k in keys[:16]:  # from disk, exact bytes (each load evicts one of carol's own)
            assert carol.get(k) == carol_values[k]
        body = metrics(node)
        assert gauge(body, "memory_bytes", "carol") <= 8 * VALUE
        assert gauge(body, "disk_bytes", "carol") <= 16 * VALUE
        assert bob.get_batch(list(bob_values)) == list(bob_values.values())
        assert gauge(body, "memory_bytes", "bob") == 4 * VALUE


def test_a_value_larger_than_the_memory_quota_is_refused(node):
    with gcache.Client(node.address, token=ALICE) as alice:
        assert alice.put(b"small", b"s" * 100) is True
        assert alice.put(b"huge", os.urandom(256 * KIB + 1)) is False  # NO_SPACE: cannot fit the quota
        assert alice.get(b"small") == b"s" * 100  # nothing of hers was evicted for it
        assert alice.get(b"huge") is None
        assert gauge(metrics(node), "puts_over_quota", "alice") == 1


def test_s3fifo_with_memory_quotas_is_refused_at_start(tmp_path):
    path = write_auth_file(tmp_path)
    settings = load_settings(["--auth-file", str(path), "--eviction-policy", "s3fifo", "--disk", "0"])
    with pytest.raises(ConfigError, match="alice, carol have a memory quota.*s3fifo cannot enforce"):
        settings.check_files()


def test_s3fifo_without_memory_quotas_is_allowed(tmp_path):
    path = tmp_path / "auth.toml"
    path.write_text(f'[tenants.bob]\ntoken = "{BOB}"\nroles = ["read", "write"]\ndisk = "0"\n')
    path.chmod(0o600)
    load_settings(["--auth-file", str(path), "--eviction-policy", "s3fifo", "--disk", "0"]).check_files()


@pytest.mark.parametrize("disk_quota", [None, 512 * KIB])
def test_owner_counts_stay_exact_through_disk_reclaims(tmp_path, disk_quota):
    """A small disk tier reclaims (drops or copies forward) whole segments: the
    tenant's counted bytes still match its values exactly (check_integrity)."""
    from gcache import _native

    tenants = [
        {"name": "carol", "token": CAROL, "roles": ["read", "write"], "memory": 64 * KIB, "disk": disk_quota},
        {"name": "bob", "token": BOB, "roles": ["read", "write"], "memory": None, "disk": None},
    ]
    server = _native.Server(
        {
            "port": 0,
            "data_dir": str(tmp_path / "data"),
            "memory_bytes": 16 << 20,
            "disk_bytes": 2 << 20,
            "segment_bytes": 256 * KIB,
            "tenants": tenants,
        }
    )
    server.start()
    try:
        values = {b"c-%03d" % i: os.urandom(VALUE) for i in range(300)}
        with gcache.Client(f"127.0.0.1:{server.port}", token=CAROL) as carol:
            for n, (key, value) in enumerate(values.items()):
                assert carol.put(key, value) is True
                if n % 50 == 0:
                    server.check_integrity()
            for key in list(values)[::37]:  # loads from disk count against the memory quota too
                got = carol.get(key)
                assert got is None or got == values[key]
            server.check_integrity()
        carol_stats = server.stats()["tenants"]["carol"]
        assert carol_stats["memory_bytes"] <= 64 * KIB
        assert carol_stats["disk_bytes"] <= (disk_quota or 2 << 20)
        assert server.stats()["tenants"]["bob"]["memory_bytes"] == 0
    finally:
        server.stop(1)
