"""The admin gRPC service (Ping, Stats, Flush) of a real gcache-server."""

from __future__ import annotations

import grpc
import msgpack

from gcache.common.processes import free_port
from tests.support.raw_protocol import STORED, RawConnection


def call(port: int, method: str) -> dict:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = channel.unary_unary(
            f"/gcache.Admin/{method}", request_serializer=msgpack.packb, response_deserializer=msgpack.unpackb
        )
        return stub({}, timeout=30)


def test_ping_stats_flush(server_factory):
    grpc_port = free_port()
    node = server_factory(extra_args=["--grpc-port", str(grpc_port)])
    assert isinstance(call(grpc_port, "Ping")["version"], str)
    with RawConnection(node.port) as c:
        assert c.put([(b"g", b"value")]) == [STORED]
    stats = call(grpc_port, "Stats")
    assert stats["counters"]["puts_stored"] == 1
    assert len(stats["histograms"]["put_batch"]) == 32
    assert call(grpc_port, "Flush") == {"flushed": True}
    with RawConnection(node.port) as c:
        assert c.get([b"g"]) == [b"value"]
    assert node.stop() == 0
