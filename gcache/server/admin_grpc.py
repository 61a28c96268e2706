"""Admin gRPC service of gcache-server: Ping, Stats, Flush.

No .proto: grpcio generic handlers with msgpack-encoded messages, so
operators' tools need only grpcio + msgpack. Methods (service gcache.Admin):

  /gcache.Admin/Ping   {}  -> {"version": str}
  /gcache.Admin/Stats  {}  -> {"counters": {...}, "gauges": {...}, "histograms": {...}}
  /gcache.Admin/Flush  {}  -> {"flushed": true}   (memory tier + warm list to disk)

Client: grpc.insecure_channel(addr).unary_unary("/gcache.Admin/Stats",
request_serializer=msgpack.packb, response_deserializer=msgpack.unpackb)({}).

With --auth-file, Flush needs the metadata `authorization: Bearer TOKEN` of a
tenant with the admin role (UNAUTHENTICATED / PERMISSION_DENIED otherwise).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import grpc
import msgpack

from gcache import __version__

SERVICE = "gcache.Admin"
WORKERS_MAX = 2  # admin calls are rare; bound the threads they may use


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False) if data else {}


def require_role(auth, context, role: str):
    """Aborts the call unless its `authorization: Bearer TOKEN` metadata names a tenant
    with `role`; returns that tenant."""
    from gcache.wire.auth import bearer_token

    header = dict(context.invocation_metadata()).get("authorization")
    tenant = auth.by_token(bearer_token(header))
    if tenant is None:
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "send the metadata 'authorization: Bearer TOKEN' with a token of the auth file",
        )
    if not tenant.has(role):
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} lacks the {role} role this call needs"
        )
    return tenant


class AdminGrpcServer:
    def __init__(self, host: str, port: int, stats: Callable[[], dict], flush: Callable[[], None], auth=None):
        flush_lock = threading.Lock()

        def do_flush(_request, context):
            if auth is not None:
                require_role(auth, context, "admin")
            with flush_lock:
                flush()
            return {"flushed": True}

        def method(fn):
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=_unpack, response_serializer=msgpack.packb
            )

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Ping": method(lambda _r, _c: {"version": __version__}),
                "Stats": method(lambda _r, _c: stats()),
                "Flush": method(do_flush),
            },
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=WORKERS_MAX), handlers=(handler,), maximum_concurrent_rpcs=16
        )
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            bound = 0
            reason = str(e)
        else:
            reason = "address in use or unavailable"
        if bound == 0:
            raise OSError(f"admin gRPC {host}:{port}: {reason}; pick a free --grpc-port, or 0 to turn it off")
        self.port = bound

    def start(self) -> None:
        self._server.start()

    def close(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait(timeout=grace_s + 5)
