"""A local cluster with --auth-file everywhere and the masters' gRPC over TLS: nodes register
with the cluster token over TLS, a tenant's client works through ClusterClient, a join moves
the tenant's (prefixed) keys to their owners, and callers without credentials are refused."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gcache import errors
from gcache.client.client import Client
from gcache.client.cluster_client import ClusterClient
from gcache.cluster.master_api import MasterClient, MasterCredentials, MasterUnavailableError
from gcache.tools.devcluster.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster  # starts masters

FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5, migration_timeout_s=15.0, memory="64MiB", disk="128MiB")


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path / "cluster", masters=1, nodes=2, auth=True, tls=True, **FAST)
    c.up(timeout_s=60)
    yield c
    c.down(timeout_s=10)


def test_secured_cluster_serves_tenants_and_rebalances_their_keys(cluster, monkeypatch):
    monkeypatch.delenv("GCACHE_TOKEN", raising=False)
    monkeypatch.delenv("GCACHE_TOKEN_FILE", raising=False)
    monkeypatch.delenv("GCACHE_MASTER_TLS_CA", raising=False)
    keys = [f"tenant-key/{i}".encode() for i in range(300)]
    values = [bytes([i % 251]) * (200 + i) for i in range(300)]
    client = ClusterClient(cluster.client_url, timeout_s=2.0, map_refresh_s=0.2, **cluster.client_kwargs)
    try:
        assert client.put_batch(keys, values) == [True] * 300
        assert client.get_batch(keys) == values
        joined = cluster.add_node(timeout_s=60)
        app_token = cluster.client_kwargs["token"]

        def keys_per_node() -> dict:
            out = {}
            for n in cluster.nodes:
                with Client(n.address, token=app_token) as c:
                    out[n.id] = c.stats()["gauges"]["keys"]
            return out

        # The join moves the tenant's prefixed keys to the owners the client computes from
        # its own keys (placement hashes the key without the prefix), then drops them here.
        deadline = time.monotonic() + 60
        counts = keys_per_node()
        while time.monotonic() < deadline and not (counts[joined.id] > 0 and sum(counts.values()) == 300):
            time.sleep(0.2)
            counts = keys_per_node()
        assert counts[joined.id] > 0 and sum(counts.values()) == 300, counts
        assert client.get_batch(keys) == values
        assert client.batch_exists_prefix(keys) == 300
    finally:
        client.close()


def test_callers_without_credentials_are_refused(cluster, monkeypatch):
    monkeypatch.delenv("GCACHE_TOKEN", raising=False)
    monkeypatch.delenv("GCACHE_TOKEN_FILE", raising=False)
    monkeypatch.delenv("GCACHE_MASTER_TLS_CA", raising=False)
    address = [m.address for m in cluster.masters]
    ca = cluster.client_kwargs["tls_ca"]
    # TLS but no token: UNAUTHENTICATED.
    with pytest.raises(errors.AuthError):
        MasterClient(address, timeout_s=2.0, credentials=MasterCredentials(tls_ca=ca)).get_map()
    # The app tenant may read the map, not change membership or read the Raft status.
    app = MasterClient(address, timeout_s=2.0, credentials=cluster.master_credentials("app"))
    assert app.get_map().epoch >= 1
    with pytest.raises(errors.AuthError) as info:
        app.call("Remove", {"node_id": cluster.nodes[0].id})
    assert info.value.kind == "forbidden"
    # Plaintext to a TLS master: no answer at all.
    with pytest.raises(MasterUnavailableError):
        MasterClient(address, timeout_s=1.0, credentials=MasterCredentials(token="x" * 20)).get_map()
    # A cluster client without a token cannot even fetch the map.
    with pytest.raises(errors.AuthError):
        ClusterClient(cluster.client_url, timeout_s=1.0, tls_ca=ca)
    # The operator CLI passes its token file and CA.
    ops_token = cluster.secrets_dir / "ops.token"
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "gcache.cli.main",
            "--token-file",
            str(ops_token),
            "admin",
            "--master",
            cluster.client_url,
            "--tls-ca",
            ca,
            "status",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "gcache.cli.main", "admin", "--master", cluster.client_url, "--tls-ca", ca, "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 6 and "Bearer" in refused.stderr


def test_mutual_tls_master_requires_a_client_certificate(tmp_path):
    from gcache.tools.devcluster import local_security
    from gcache.tools.devcluster.local_masters import start_masters, wait_leader

    pki = local_security.make_pki(tmp_path / "pki", ["127.0.0.21"])
    masters = start_masters(1, tmp_path / "m", tls_cert=pki["cert"], tls_key=pki["key"], tls_ca=pki["ca"])
    try:
        address = [m.grpc_address for m in masters]
        with_cert = MasterCredentials(tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
        wait_leader(address, timeout_s=30, credentials=with_cert)
        assert MasterClient(address, timeout_s=2.0, credentials=with_cert).get_map() is not None
        with pytest.raises(MasterUnavailableError):
            MasterClient(address, timeout_s=1.0, credentials=MasterCredentials(tls_ca=pki["ca"])).get_map()
    finally:
        for m in masters:
            m.stop()
