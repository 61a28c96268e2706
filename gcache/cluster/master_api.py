"""The master's gRPC API (service gcache.Master) and a client that tries every master.

No .proto: grpcio generic handlers with msgpack-encoded maps, like the node's
admin service. Every replica answers every method; writes reaching a follower
are forwarded to the Raft leader, reads are answered from the replica's own
copy of the map (possibly a little behind: epochs only grow, so callers keep
the newest map they have seen).

Methods (request -> response):

  Register   {"node_id", "address", "weight", "admin"}        -> {"map", "state"}
             A new or dead node enters as `joining`; a live node with the same
             address is left as it is (a quick restart). A draining node stays
             draining.
  Heartbeat  {"node_id", "epoch", "rebalanced_epoch", "degraded"}
                                                              -> {"epoch", "state"}
             state "unknown" (removed, or never registered): register again.
             state "dead": the node was declared dead; register again.
             rebalanced_epoch: the newest epoch whose migration this node has
             finished pushing. degraded: "" or why the node wants to drain itself.
  GetMap     {"if_newer_than": int}                           -> {"map": map | None, "has_leader"}
             has_leader false: this replica knows no Raft leader (cut off from the
             quorum?), so its map may be behind; the client asks another next time.
  Drain      {"node_id"}                                      -> {"map"}
  Remove     {"node_id"}                                      -> {"map"}
  Status     {}                                               -> {"map", "raft": {...},
                                                                  "rebalanced_epoch": {id: epoch},
                                                                  "heartbeat_age_s": {id: s}}
             raft: {"self", "leader" (Raft addresses; leader None while unknown),
             "is_leader", "term", "ready" (a leader is known), "has_quorum",
             "commit_index", "last_applied", "peers"}. heartbeat_age_s: seconds
             since this replica applied each node's last heartbeat.

Errors are gRPC status codes with a message saying what to do:
UNAVAILABLE (no leader / no quorum: retry), NOT_FOUND (unknown node id),
INVALID_ARGUMENT (bad field), FAILED_PRECONDITION (a state change not allowed).

Security (docs/security.md): a master started with --tls-cert/--tls-key serves
TLS (and with --tls-ca requires client certificates signed by that CA); with
--auth-file every call needs the metadata `authorization: Bearer TOKEN`:
Register and Heartbeat the cluster role, Drain the admin or cluster role,
Remove and Status the admin role (Status also cluster), GetMap any role.
UNAUTHENTICATED / PERMISSION_DENIED otherwise.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import grpc
import msgpack

from gcache import errors
from gcache.cluster.cluster_map import ClusterMap
from gcache.common.address import parse_host_port

SERVICE = "gcache.Master"
METHODS = ("Register", "Heartbeat", "GetMap", "Drain", "Remove", "Status")
MASTERS_MAX = 9
CALL_TIMEOUT_S = 2.0
# gRPC's default reconnect backoff grows to 120 s: a master that comes back
# would stay "unavailable" to this client long after it is up again.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False) if data else {}


def parse_master_url(url: str) -> list[str]:
    """'gcache://h1:p1,h2:p2' or 'h1:p1,h2:p2' -> ['h1:p1', 'h2:p2']."""
    if not isinstance(url, str):
        raise errors.InvalidArgumentError(f"master addresses must be a str, got {type(url).__name__}")
    body = url[len("gcache://") :] if url.startswith("gcache://") else url
    addrs = [a.strip() for a in body.split(",") if a.strip()]
    if not 1 <= len(addrs) <= MASTERS_MAX:
        raise errors.InvalidArgumentError(
            f"give 1..{MASTERS_MAX} master addresses as host:port[,host:port...], got {url!r}"
        )
    for a in addrs:
        try:
            parse_host_port(a)
        except ValueError:
            raise errors.InvalidArgumentError(f"master address {a!r} is not host:port") from None
    return addrs


TLS_CA_ENV = "GCACHE_MASTER_TLS_CA"


@dataclass(frozen=True)
class MasterCredentials:
    """How a caller proves itself to the masters: a token (sent as a bearer token, over
    TLS when tls_ca is set) and TLS files (PEM paths): the CA that signed the masters'
    certificates, and a client certificate + key where the masters require one."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_env(cls, token: str | None = None, tls_ca: str | None = None, **kwargs) -> MasterCredentials:
        """Fills what is not given from $GCACHE_TOKEN (or $GCACHE_TOKEN_FILE) and $GCACHE_MASTER_TLS_CA."""
        from gcache.wire.auth import resolve_token

        return cls(token=resolve_token(token), tls_ca=tls_ca or os.environ.get(TLS_CA_ENV) or None, **kwargs)

    def channel(self, address: str) -> grpc.Channel:
        if not self.tls_ca:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        try:
            ca = _read(self.tls_ca)
            key = _read(self.tls_key) if self.tls_key else None
            cert = _read(self.tls_cert) if self.tls_cert else None
        except OSError as e:
            raise errors.InvalidArgumentError(f"cannot read a master TLS file: {e}") from None
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)

    def metadata(self):
        return (("authorization", f"Bearer {self.token}"),) if self.token else None


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class MasterUnavailableError(errors.ConnectionError):
    """No master answered (all down, partitioned, or without a leader): retry later."""


class MasterClient:
    """Calls the master replicas in turn, starting with the last one that answered.

    Thread-safe. Each call tries every address once, each with `timeout_s`;
    UNAVAILABLE / DEADLINE_EXCEEDED move on to the next address, other gRPC
    errors are raised as they are (grpc.RpcError).
    """

    def __init__(self, addresses, timeout_s: float = CALL_TIMEOUT_S, credentials: MasterCredentials | None = None):
        self.addresses = parse_master_url(addresses) if isinstance(addresses, str) else list(addresses)
        self.timeout_s = timeout_s
        self.credentials = credentials or MasterCredentials.from_env()
        self._metadata = self.credentials.metadata()
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._preferred = 0

    def _stub(self, address: str, method: str):
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = self.credentials.channel(address)
        return ch.unary_unary(f"/{SERVICE}/{method}", request_serializer=pack, response_deserializer=unpack)

    def call(self, method: str, request: dict | None = None, timeout_s: float | None = None) -> dict:
        if method not in METHODS:
            raise ValueError(f"unknown master method {method!r}; known: {sorted(METHODS)}")
        timeout_s = timeout_s or self.timeout_s
        n = len(self.addresses)
        last = None
        for i in range(n):
            idx = (self._preferred + i) % n
            try:
                answer = self._stub(self.addresses[idx], method)(
                    request or {}, timeout=timeout_s, metadata=self._metadata
                )
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    last = e
                    continue
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    kind = "unauthenticated" if e.code() == grpc.StatusCode.UNAUTHENTICATED else "forbidden"
                    raise errors.AuthError(
                        f"gcache-master {self.addresses[idx]} refused {method}: {e.details()}; pass a token "
                        "of the masters' --auth-file (GCACHE_TOKEN, --token-file) with the role the call needs",
                        kind,
                        self.addresses[idx],
                    ) from None
                raise
            self._preferred = idx
            return answer
        detail = last.details() if last is not None else "no address"
        raise MasterUnavailableError(
            f"no gcache-master answered {method} ({', '.join(self.addresses)}): {detail}; "
            "check the masters are running and a majority of them can reach each other"
        )

    def get_map(self, if_newer_than: int = -1) -> ClusterMap | None:
        answer = self.call("GetMap", {"if_newer_than": if_newer_than})
        if not answer.get("has_leader", True):  # do not stick to a replica cut off from the quorum
            self._preferred = (self._preferred + 1) % len(self.addresses)
        return ClusterMap.from_dict(answer["map"]) if answer.get("map") else None

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
