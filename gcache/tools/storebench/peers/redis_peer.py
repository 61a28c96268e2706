"""Redis through redis-py pipelines (SET / GET / EXISTS); the local redis-server it measures
against is gcache.tools.devcluster.local_redis.LocalRedis."""

from __future__ import annotations

import numpy as np

from gcache.common.address import parse_host_port
from gcache.tools.devcluster.local_redis import UNIX_PREFIX
from gcache.tools.storebench.peers.base import Peer, PeerSpec

REDIS_SOCKET_TIMEOUT_S = 60.0


class RedisPeer(Peer):
    name = "redis"

    def __init__(self, address: str):
        import redis  # optional dependency: only --vs redis needs it

        if address.startswith(UNIX_PREFIX):
            self.client = redis.Redis(
                unix_socket_path=address[len(UNIX_PREFIX) :], socket_timeout=REDIS_SOCKET_TIMEOUT_S
            )
        else:
            host, port = parse_host_port(address)
            self.client = redis.Redis(host=host, port=port, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
        self.client.ping()

    def put_from(self, keys, buf, size):
        view = memoryview(buf)
        pipe = self.client.pipeline(transaction=False)
        for i, key in enumerate(keys):
            pipe.set(key, view[i * size : (i + 1) * size])
        return sum(1 for ok in pipe.execute() if ok)

    def get_into(self, keys, buf, size):
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        hits = 0
        for i, value in enumerate(pipe.execute()):
            if value is not None and len(value) == size:
                # redis-py returns bytes; landing them in the caller's buffer is part of the job
                buf[i * size : (i + 1) * size] = np.frombuffer(value, dtype=np.uint8)
                hits += 1
        return hits

    def exists(self, keys):
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return sum(pipe.execute())

    def get_one(self, key):
        return self.client.get(key)

    def remove(self, keys):
        if keys:
            self.client.delete(*keys)

    def close(self):
        self.client.close()


def open_peer(spec: PeerSpec) -> Peer:
    return RedisPeer(spec.address)


def parse_redis_url(url: str) -> str:
    """'redis://host:port' or 'host:port' -> 'host:port'."""
    address = url.split("://", 1)[-1].split("/", 1)[0]
    if ":" not in address:
        address += ":6379"
    return address
