"""Issue 21, finding 10: a node restarted (or marked dead and back) under shared-memory
reads and writes never throws anything but gcache.errors out of a data call.

A real gcache-server, a ClusterClient and a single-node Client on transport="shm",
several threads doing batch_put_from / batch_get_into of values larger than the
inline limit (so they are copied through the mapped arena), while the server is
killed -9 and restarted on its port and the map marks the node dead and alive
again (which closes the node's Client, and its arena mapping, mid-call). Every
outcome must be a value with its exact bytes, a miss, or a gcache.errors error.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest

from gcache import errors
from gcache.client.client import ServerClient
from gcache.client.cluster_client import ClusterClient
from gcache.cluster.cluster_map import ACTIVE, DEAD, ClusterMap, NodeInfo
from gcache.common.processes import free_port
from tests.support.servers import ServerProcess

pytestmark = [pytest.mark.process, pytest.mark.slow]

KEYS = 64
BATCH = 6
VALUE_BYTES_MAX = 96 * 1024  # > the 16 KiB inline limit: copied out of the arena
ROUNDS = 10


def value_for(key: bytes) -> bytes:
    size = 20_000 + int.from_bytes(hashlib.sha256(key).digest()[:4], "little") % (VALUE_BYTES_MAX - 20_000)
    block = hashlib.sha256(b"v" + key).digest()
    return (block * (size // len(block) + 1))[:size]


def node_map(epoch: int, address: str, state: str) -> ClusterMap:
    return ClusterMap(epoch, (NodeInfo("n1", address, 1, state),))


class Worker(threading.Thread):
    """put/get batches until `stop`; counts outcomes; anything outside gcache.errors is kept."""

    def __init__(self, client, seed: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.client, self.rng, self.stop = client, random.Random(seed), stop
        self.hits = self.misses = self.stored = self.gcache_errors = 0
        self.wrong: list[str] = []
        self.foreign: list[BaseException] = []

    def run(self) -> None:
        buf = bytearray(BATCH * VALUE_BYTES_MAX)
        while not self.stop.is_set():
            keys = [b"k%d" % self.rng.randrange(KEYS) for _ in range(BATCH)]
            keys = list(dict.fromkeys(keys))
            try:
                if self.rng.random() < 0.4:
                    values = [value_for(k) for k in keys]
                    self.stored += sum(self.client.batch_put_from(keys, values))
                    continue
                offsets = [j * VALUE_BYTES_MAX for j in range(len(keys))]
                got = self.client.batch_get_into(keys, buf, [VALUE_BYTES_MAX] * len(keys), offsets)
            except errors.GCacheError:
                self.gcache_errors += 1
                continue
            except BaseException as exc:  # noqa: BLE001 - what this test looks for
                self.foreign.append(exc)
                continue
            for j, (key, size) in enumerate(zip(keys, got)):
                if size is None:
                    self.misses += 1
                    continue
                at = j * VALUE_BYTES_MAX
                if bytes(buf[at : at + size]) != value_for(key):
                    self.wrong.append(f"{key!r}: {size} bytes that are not its value")
                self.hits += 1


def test_restarts_and_map_flaps_under_shm_io_raise_only_gcache_errors(tmp_path):
    server = ServerProcess(tmp_path / "node", memory="64MiB", disk="0").start()
    epoch = 1
    cluster = ClusterClient(
        f"gcache://127.0.0.1:{free_port()}",  # no master: the map comes from this test
        initial_map=node_map(epoch, server.address, ACTIVE),
        transport="shm",
        timeout_s=2.0,
        suspect_s=0.05,
    )
    single = ServerClient(server.address, transport="shm", timeout_s=2.0)
    assert single.transport == "shm"
    stop = threading.Event()
    workers = [Worker(cluster, s, stop) for s in range(3)] + [Worker(single, 10 + s, stop) for s in range(2)]
    try:
        for w in workers:
            w.start()
        rng = random.Random(7)
        for r in range(ROUNDS):
            time.sleep(0.3 + rng.random() * 0.3)
            if r % 3 == 2:  # kill -9 and restart on the same port (a new arena)
                server.kill()
                epoch += 1
                cluster._maps.offer(node_map(epoch, server.address, DEAD))
                server.start()
            else:  # marked dead while it still answers (a missed heartbeat), then back
                epoch += 1
                cluster._maps.offer(node_map(epoch, server.address, DEAD))
                time.sleep(rng.random() * 0.05)
            epoch += 1
            cluster._maps.offer(node_map(epoch, server.address, ACTIVE))
        time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
        cluster.close()
        single.close()
        server.stop()
    assert not any(w.is_alive() for w in workers)
    foreign = [e for w in workers for e in w.foreign]
    assert not foreign, f"{len(foreign)} exceptions outside gcache.errors, first: {foreign[0]!r}"
    assert [x for w in workers for x in w.wrong] == []
    assert sum(w.hits for w in workers) > 0 and sum(w.stored for w in workers) > 0
