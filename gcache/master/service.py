"""gRPC servicer of gcache.Master (see gcache.cluster.master_api for the methods).

Requests are validated here, so that bad input gets INVALID_ARGUMENT with a
message saying what to send; writes become Raft commands (MasterRaft.apply),
reads answer from this replica's copy. The server is small and bounded: few
worker threads, a cap on concurrent calls and on message size.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc

from gcache.cluster import master_api
from gcache.cluster.cluster_map import NODE_ID_BYTES_MAX, WEIGHT_MAX
from gcache.common.address import parse_host_port
from gcache.master.raft_state import MasterRaft, RaftUnavailableError
from gcache.master.state import DEGRADED_CHARS_MAX, FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, StateError

log = logging.getLogger("gcache.master")

WORKERS_MAX = 8  # calls mostly wait on a Raft commit (milliseconds)
CONCURRENT_RPCS_MAX = 256  # beyond: RESOURCE_EXHAUSTED at once instead of a queue
MESSAGE_BYTES_MAX = 4 << 20  # a map of NODES_MAX nodes fits with room to spare
COMMIT_TIMEOUT_S_MAX = 5.0  # never hold a worker longer than this on one command
COMMIT_TIMEOUT_S_DEFAULT = master_api.CALL_TIMEOUT_S

_STATUS_OF = {
    NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
}


class _Invalid(Exception):
    pass


def _field(request: dict, name: str, kind, default=None, required: bool = True):
    value = request.get(name, default)
    if value is None and not required:
        return default
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise _Invalid(f"field {name!r} must be {kind.__name__}, got {value!r:.100}")
    return value


def _address(value: str, name: str, allow_empty: bool = False) -> str:
    if allow_empty and value == "":
        return value
    try:
        parse_host_port(value)
    except ValueError:
        raise _Invalid(f"field {name!r} must be host:port, got {value!r:.100}") from None
    return value


def _node_id(request: dict) -> str:
    node_id = _field(request, "node_id", str)
    if not 0 < len(node_id.encode()) <= NODE_ID_BYTES_MAX:
        raise _Invalid(f"node_id must be 1..{NODE_ID_BYTES_MAX} bytes, got {node_id!r:.150}")
    return node_id


# Roles that may call each method when the master has --auth-file (None: any tenant).
METHOD_ROLES = {
    "Register": ("cluster",),
    "Heartbeat": ("cluster",),
    "GetMap": None,
    "Drain": ("admin", "cluster"),
    "Remove": ("admin",),
    "Status": ("admin", "cluster"),
}


class MasterService:
    """The handlers; `raft` is this replica's MasterRaft, `auth` an AuthConfig (None: no tokens)."""

    def __init__(self, raft: MasterRaft, auth=None):
        self.raft = raft
        self.auth = auth

    def _check_token(self, method: str, context) -> None:
        from gcache.wire.auth import bearer_token

        header = dict(context.invocation_metadata()).get("authorization")
        tenant = self.auth.by_token(bearer_token(header))
        if tenant is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this master has --auth-file: send the metadata 'authorization: Bearer TOKEN'",
            )
        roles = METHOD_ROLES[method]
        if roles is not None and not any(tenant.has(r) for r in roles):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} lacks the role {method} needs ({' or '.join(roles)})",
            )

    # -- plumbing ----------------------------------------------------------------

    def _write(self, context, command: str, *args):
        remaining = context.time_remaining() if context is not None else None
        timeout_s = COMMIT_TIMEOUT_S_DEFAULT if remaining is None else remaining - 0.05
        timeout_s = min(COMMIT_TIMEOUT_S_MAX, timeout_s)
        if timeout_s <= 0:
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the call's deadline passed before it ran; retry with a longer timeout",
            )
        try:
            return self.raft.apply(command, *args, timeout_s=timeout_s)
        except RaftUnavailableError as e:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{command} not committed on master {self.raft.self_address}: {e}"
            )
        except StateError as e:
            context.abort(_STATUS_OF.get(e.code, grpc.StatusCode.INTERNAL), str(e))

    def _handler(self, method: str, fn):
        def run(request, context):
            if self.auth is not None:
                self._check_token(method, context)
            if not isinstance(request, dict):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"the request must be a msgpack map, got {type(request).__name__}"
                )
            try:
                return fn(request, context)
            except _Invalid as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return grpc.unary_unary_rpc_method_handler(
            run, request_deserializer=master_api.unpack, response_serializer=master_api.pack
        )

    # -- methods -----------------------------------------------------------------

    def register(self, request: dict, context) -> dict:
        node_id = _node_id(request)
        address = _address(_field(request, "address", str), "address")
        weight = _field(request, "weight", int)
        if not 1 <= weight <= WEIGHT_MAX:
            raise _Invalid(f"weight must be in [1, {WEIGHT_MAX}] (GiB of capacity), got {weight}")
        admin = _address(_field(request, "admin", str, default=""), "admin", allow_empty=True)
        result = self._write(context, "register", node_id, address, weight, admin)
        return {"map": result["map"].to_dict(), "state": result["state"]}

    def heartbeat(self, request: dict, context) -> dict:
        node_id = _node_id(request)
        _field(request, "epoch", int, default=0)
        rebalanced_epoch = _field(request, "rebalanced_epoch", int, default=0)
        if rebalanced_epoch < 0:
            raise _Invalid(f"rebalanced_epoch must be >= 0, got {rebalanced_epoch}")
        degraded = _field(request, "degraded", str, default="")[:DEGRADED_CHARS_MAX]
        return self._write(context, "heartbeat", node_id, rebalanced_epoch, degraded)

    def get_map(self, request: dict, context) -> dict:
        if_newer_than = _field(request, "if_newer_than", int, default=-1)
        current = self.raft.replicated_map.map
        # A replica that knows no leader may be cut off from the quorum, its map behind:
        # it still answers (a client with no map is better off with it), and says so.
        return {
            "map": current.to_dict() if current.epoch > if_newer_than else None,
            "has_leader": self.raft.leader() is not None,
        }

    def drain(self, request: dict, context) -> dict:
        return {"map": self._write(context, "drain", _node_id(request))["map"].to_dict()}

    def remove(self, request: dict, context) -> dict:
        return {"map": self._write(context, "remove", _node_id(request))["map"].to_dict()}

    def status(self, request: dict, context) -> dict:
        snap = self.raft.snapshot()
        now = time.monotonic()
        return {
            "map": snap.map.to_dict(),
            "raft": self.raft.raft_status(),
            "rebalanced_epoch": dict(snap.rebalanced),
            "heartbeat_age_s": {node_id: round(now - t, 3) for node_id, t in snap.last_seen.items()},
        }

    def generic_handler(self):
        return grpc.method_handlers_generic_handler(
            master_api.SERVICE,
            {
                "Register": self._handler("Register", self.register),
                "Heartbeat": self._handler("Heartbeat", self.heartbeat),
                "GetMap": self._handler("GetMap", self.get_map),
                "Drain": self._handler("Drain", self.drain),
                "Remove": self._handler("Remove", self.remove),
                "Status": self._handler("Status", self.status),
            },
        )


class MasterGrpcServer:
    """Binds at construction (so a taken port is reported before anything else starts)."""

    def __init__(self, address: str, service: MasterService, tls=None):
        """tls: None (plaintext) or (cert PEM bytes, key PEM bytes, client CA PEM bytes or None)."""
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=WORKERS_MAX, thread_name_prefix="gcache-master-grpc"),
            handlers=(service.generic_handler(),),
            maximum_concurrent_rpcs=CONCURRENT_RPCS_MAX,
            options=[
                ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
                ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
                ("grpc.so_reuseport", 0),
            ],
        )
        try:
            if tls is None:
                bound = self._server.add_insecure_port(address)
            else:
                cert, key, client_ca = tls
                credentials = grpc.ssl_server_credentials(
                    [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
                )
                bound = self._server.add_secure_port(address, credentials)
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(
                f"cannot listen for gRPC on {address}: address in use or not local; pick another --grpc HOST:PORT"
            )
        self.port = bound

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait(timeout=grace_s + 5)
