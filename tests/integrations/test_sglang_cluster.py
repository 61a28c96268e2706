"""The backend on a GCache cluster (gcache_url "gcache://master"): pages spread over nodes."""

from __future__ import annotations

import pytest

import gcache
from gcache.tools.devcluster.local_cluster import LocalCluster

from .sglang_support import chain, page_bytes, slots

pytestmark = pytest.mark.cluster  # starts masters

FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5, memory="64MiB", disk="128MiB")


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path / "cluster", masters=1, nodes=2, **FAST)
    c.up(timeout_s=60)
    yield c
    c.down(timeout_s=10)


def test_v1_round_trip_and_prefix_over_a_cluster(cluster, storage_config, attach, host_pool):
    src = host_pool(seed=40)
    backend = attach(storage_config(cluster.client_url), src)
    assert type(backend.client).__name__ == "ClusterClient"
    hashes = chain(8, salt=40)
    assert backend.batch_set_v1(hashes[:3] + hashes[4:], slots(src, [0, 1, 2, 4, 5, 6, 7])) == [True] * 7
    assert backend.batch_exists(hashes) == 3  # page 3 missing

    # Each node holds a share of the entries, and together exactly all of them.
    entries = backend._kv_pages().keys.entries(hashes[:3] + hashes[4:])
    held = []
    for node in cluster.nodes:
        with gcache.Client(node.address) as one:
            held.append(one.batch_is_exist(entries))
    assert all(any(h) for h in held)
    assert [a or b for a, b in zip(*held)] == [True] * len(entries)

    dst = host_pool()
    reader = attach(storage_config(cluster.client_url), dst)
    assert reader.batch_get_v1(hashes, slots(dst, list(range(8, 16)))) == [True] * 3 + [False] + [True] * 4
    assert [page_bytes(dst, p) for p in (8, 9, 10, 12, 13, 14, 15)] == [
        page_bytes(src, p) for p in (0, 1, 2, 4, 5, 6, 7)
    ]
    assert not any(page_bytes(dst, 11))
