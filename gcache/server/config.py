"""gcache-server configuration: command-line flags, an optional TOML file, sizes.

Precedence: command line > config file > defaults. Every flag can be set in
the file under the same name (dashes or underscores), e.g. `memory = "1GiB"`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tomllib
from dataclasses import asdict, dataclass, field, fields

from gcache.common.address import parse_host_port
from gcache.common.flags import add_flags, flag, flag_of
from gcache.common.units import parse_size
from gcache.errors import ConfigError

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3


# Argument groups of gcache-server --help (created in the order their first field comes).
LIMITS = 'abuse limits (docs/protocol.md, "Limits")'
EVICTION = "eviction (docs/storage.md)"
LOCAL = 'same-host and RDMA clients (docs/protocol.md, "Shared memory and RDMA")'
SECURITY = "authentication (docs/security.md)"
CLUSTER = "cluster (docs/cluster.md)"
EVICTION_POLICIES = ("chain", "s3fifo", "lru")
LOG_LEVELS = ["debug", "info", "warning", "error"]


@dataclass
class ServerSettings:
    """Every setting of gcache-server; each is also a flag (its help here: gcache.common.flags)
    and a config file key. The flags default to None, so the file can fill what the command
    line left out; the help states each default."""

    host: str = field(default="127.0.0.1", metadata=flag("address to listen on (default 127.0.0.1)"))
    port: int = field(default=7600, metadata=flag("data port (default 7600; 0 = any free port)"))
    memory: int = field(
        default=1 << 30, metadata=flag("memory tier (shared-memory arena) size (default 1GiB)", size=True)
    )
    disk: int = field(
        default=4 << 30,
        metadata=flag("disk tier bound, sum of segment files; 0 = no disk tier (default 4GiB)", size=True),
    )
    data_dir: str = field(
        default="./gcache-data",
        metadata=flag(
            "directory for disk segments, the warm list and the Unix socket; created mode 0700, "
            "refused if other users may read or write it (default ./gcache-data)"
        ),
    )
    admin_host: str | None = field(  # None: same as host
        default=None, metadata=flag("address of the admin HTTP server (default: --host)")
    )
    admin_port: int = field(
        default=7601,
        metadata=flag(
            "admin HTTP port: /metrics (Prometheus), /healthz, /readyz, /cluster, "
            "POST /flush, POST /drain; "
            "0 = off (default 7601)"
        ),
    )
    grpc_port: int = field(
        default=0, metadata=flag("admin gRPC port (Ping, Stats, Flush; msgpack messages); 0 = off (default 0)")
    )
    value_bytes_max: int = field(default=64 << 20, metadata=flag("largest value accepted (default 64MiB)", size=True))
    batch_keys_max: int = field(default=16384, metadata=flag("most keys in one batch request (default 16384)"))
    frame_payload_bytes_max: int = field(
        default=2 << 30,
        metadata=flag("largest payload of one request or response frame (default 2GiB)", size=True),
    )
    connections_max: int = field(
        default=1024, metadata=flag("most open client connections (default 1024)", group=LIMITS)
    )
    connections_per_address_max: int = field(  # 0 = no cap
        default=256,
        metadata=flag(
            "most open connections from one peer IP address, so one peer cannot take "
            "every slot; 0 = no cap (default 256)",
            group=LIMITS,
        ),
    )
    connections_per_tenant_max: int = field(  # 0 = no cap (auth only)
        default=512,
        metadata=flag("most open connections of one tenant (with --auth-file); 0 = no cap (default 512)", group=LIMITS),
    )
    idle_timeout_s: float = field(
        default=300.0,
        metadata=flag(
            "close a connection that sent no data request (PUT/GET/EXISTS/REMOVE) for this "
            "long; PING and STATS do not count (default 300)",
            group=LIMITS,
        ),
    )
    stall_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "close a connection whose frame (or response) stops moving for this long; "
            "a frame must also arrive within this plus 1 s per MiB (default 30)",
            group=LIMITS,
        ),
    )
    meta_buffer_bytes_max: int = field(
        default=256 << 20,
        metadata=flag(
            "request metadata buffered by all connections together, beyond 64KiB each; "
            "a frame that cannot get room within the stall timeout is refused "
            "(default 256MiB)",
            group=LIMITS,
            size=True,
        ),
    )
    put_reserve_bytes_max: int = field(  # 0 = memory / 8
        default=0,
        metadata=flag(
            "arena bytes PUTs may hold reserved before their values arrive, all "
            "connections together (one address or tenant: a quarter); a value that "
            "cannot get room within the stall timeout is refused NO_SPACE "
            "(default --memory / 8, at least 2 x --value-bytes-max, at most --memory / 2)",
            group=LIMITS,
            size=True,
        ),
    )
    index_bytes_max: int = field(  # 0 = (memory + disk) / 8
        default=0,
        metadata=flag(
            "heap the key index may use (about 250 B plus the key per value, either "
            "tier); a new key beyond it drops the oldest disk segment, then memory "
            "values (default (--memory + --disk) / 8, at least 32MiB)",
            group=LIMITS,
            size=True,
        ),
    )
    segment_bytes: int = field(
        default=64 << 20, metadata=flag("target disk segment file size (default 64MiB)", size=True)
    )
    warm_restart: bool = field(default=True, metadata=flag("reload the warm list into memory at start (default on)"))
    # Memory-tier eviction (docs/storage.md, "Eviction").
    eviction_policy: str = field(
        default="chain",
        metadata=flag(
            "memory-tier eviction: chain (chain-aware weighted recency, tuned online), s3fifo, or lru (default chain)",
            group=EVICTION,
            choices=EVICTION_POLICIES,
        ),
    )
    eviction_fresh_weight: float = field(  # chain: 0 = tuned online
        default=0.0,
        metadata=flag(
            "chain: how many times faster a value never read since its put ages than a "
            "read one; 1 = plain LRU order; 0 = picked online among 1, 2, 4, 8, 16, 32 (default 0)",
            group=EVICTION,
            metavar="W",
        ),
    )
    eviction_ghost_factor: float = field(
        default=2.0,
        metadata=flag(
            "chain: evicted keys remembered, per value in memory; a key put again while "
            "remembered counts as read (default 2)",
            group=EVICTION,
            metavar="F",
        ),
    )
    eviction_tail_hint: bool = field(
        default=True,
        metadata=flag(
            "chain: the last value of a put batch (a chain's partial tail block) is evicted first (default on)",
            group=EVICTION,
        ),
    )
    eviction_small_queue_fraction: float = field(
        default=0.10,
        metadata=flag(
            "s3fifo: share of the memory tier for the small FIFO (default 0.10)", group=EVICTION, metavar="FRACTION"
        ),
    )
    disk_exclusive: bool = field(
        default=True,
        metadata=flag(
            "a value read back from disk into memory gives up its disk copy, so memory and "
            "disk hold their sum (default on; off: it keeps the copy and leaves memory "
            "again without a write)"
        ),
    )
    # Same-host and RDMA clients (docs/protocol.md, "Shared memory and RDMA").
    unix_socket: str = field(  # "auto" = <data-dir>/gcache.sock; "" = none
        default="auto",
        metadata=flag(
            "Unix socket for clients on this host: they map the arena and copy values "
            "themselves (transport 'shm'); mode 0600, so only this user's processes; "
            "'' = none (default <data-dir>/gcache.sock; the node creates the dir, 0700); "
            "with --auth-file shared memory "
            "is refused, since the arena holds every tenant's values",
            group=LOCAL,
            metavar="PATH",
        ),
    )
    shm_lease_s: float = field(
        default=10.0,
        metadata=flag(
            "how long a LOOKUP lease pins its values and a RESERVE holds its blocks; "
            "a connection past a reservation's deadline is closed (default 10)",
            group=LOCAL,
        ),
    )
    shm_scrub: bool = field(
        default=True,
        metadata=flag(
            "once a shared-memory reader has copied a value a shared-memory PUT committed "
            "unread, a node thread checks it off the request path, so its later readers copy "
            "it without hashing (default on; off: such readers hash every copy; docs/security.md, "
            "'Checksums a writer declares')",
            group=LOCAL,
        ),
    )
    spin_us: int = field(
        default=50,
        metadata=flag(
            "after answering a small request, a connection's thread polls its socket this many "
            "microseconds for the next one before it sleeps, so a client's loop of small calls "
            "is answered without a wake-up; bounded to a share of the cores, and backing off "
            "on connections whose requests come slower; 0 = never (default 50)",
            group=LOCAL,
        ),
    )
    rdma_device: str = field(  # "" = no RDMA
        default="",
        metadata=flag(
            "register the arena with this RDMA device (pyverbs) so remote clients read "
            "and write it one-sided (transport 'rdma'); default: none",
            group=LOCAL,
            metavar="NAME",
        ),
    )
    shutdown_grace_s: float = field(
        default=10.0, metadata=flag("on SIGTERM, how long requests in flight may take to finish (default 10)")
    )
    log_level: str = field(default="info", metadata=flag("log verbosity (default info)", choices=LOG_LEVELS))
    # Authentication (docs/security.md); "" = off. The parsed file is `self.auth`
    # (not a field, so tokens never reach as_dict() and the config log line).
    auth_file: str = field(
        default="",
        metadata=flag(
            "TOML file of tenants (token, roles, memory/disk quotas): clients must "
            "authenticate (challenge-response), keys are namespaced per tenant, a tenant "
            "over its memory quota evicts only its own values (needs --eviction-policy "
            'chain or lru), disk "0" keeps its values off disk, POST /flush and /drain '
            "need an admin token (default: none, no authentication)",
            group=SECURITY,
            metavar="FILE",
        ),
    )
    auth_timeout_s: float = field(
        default=5.0,
        metadata=flag(
            "close a connection that has not authenticated within this long; "
            "before AUTH only PING is answered (default 5)",
            group=SECURITY,
        ),
    )
    preauth_connections_max: int = field(  # not yet authenticated (auth only); docs/protocol.md, "Limits"
        default=256,
        metadata=flag(
            "most connections not yet authenticated, apart from --connections-max: when "
            "full, one of them is dropped (never a client's own older one; a reconnect's "
            "before others for a reconnect; addresses that authenticated lately last; else "
            "the oldest), so a client that authenticates promptly gets in (default 256)",
            group=SECURITY,
        ),
    )
    preauth_connections_per_address_max: int = field(
        default=64,
        metadata=flag(
            "most connections not yet authenticated from one address; when full, that "
            "address's oldest is dropped (default 64)",
            group=SECURITY,
        ),
    )
    # Cluster membership (docs/cluster.md, "Node side"); master "" = standalone node.
    master: str = field(
        default="",
        metadata=flag(
            "gcache-master replicas to register with (default: none, a standalone node)",
            group=CLUSTER,
            metavar="HOST:PORT[,HOST:PORT...]",
        ),
    )
    node_id: str = field(  # "" = the advertise address
        default="", metadata=flag("this node's id in the map (default: --advertise)", group=CLUSTER, metavar="ID")
    )
    advertise: str = field(  # "" = host:port (the bound port if --port 0)
        default="",
        metadata=flag(
            "data address other nodes and clients use (default: --host:--port; "
            "required with --master when --host is 0.0.0.0 or ::)",
            group=CLUSTER,
            metavar="HOST:PORT",
        ),
    )
    heartbeat_interval_s: float = field(
        default=1.0, metadata=flag("seconds between heartbeats to the master (default 1.0)", group=CLUSTER)
    )
    rebalance_batch_bytes: int = field(
        default=64 << 20,
        metadata=flag("bytes moved per batch when keys move to their owners (default 64MiB)", group=CLUSTER, size=True),
    )
    # TLS towards the masters' gRPC API (PEM paths): their CA, and a client cert where they require one.
    master_tls_ca: str = field(
        default="",
        metadata=flag(
            "CA of the masters' TLS certificates: talk TLS to them (default: plaintext; "
            "with --auth-file the node sends its cluster-role token)",
            group=CLUSTER,
            metavar="PEM",
        ),
    )
    master_tls_cert: str = field(
        default="",
        metadata=flag("client certificate for masters that require one (their --tls-ca)", group=CLUSTER, metavar="PEM"),
    )
    master_tls_key: str = field(
        default="", metadata=flag("private key of --master-tls-cert", group=CLUSTER, metavar="PEM")
    )
    memory_pressure_drain: float = field(  # 0 = off
        default=0.0,
        metadata=flag(
            "drain this node when more than this fraction of puts is refused "
            "for lack of space over a minute; 0 = off (default 0)",
            group=CLUSTER,
            metavar="FRACTION",
        ),
    )

    def check_files(self) -> None:
        """At start (not when parsing, so deploy files can be checked anywhere): the TLS files
        must be readable and the auth file must hold no example placeholder token."""
        for option, path in (
            ("--master-tls-ca", self.master_tls_ca),
            ("--master-tls-cert", self.master_tls_cert),
            ("--master-tls-key", self.master_tls_key),
        ):
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{option} {path}: not a readable file")
        if self.auth:
            from gcache.wire.auth import placeholder_tenants

            names = placeholder_tenants(self.auth)
            if names:
                raise ConfigError(
                    f"auth file {self.auth_file}: tenant(s) {', '.join(names)} still have the "
                    "example's placeholder token; generate real ones (docs/security.md)"
                )
            quota_names = sorted(t.name for t in self.auth.tenants.values() if t.memory)
            if quota_names and self.eviction_policy == "s3fifo":
                raise ConfigError(
                    f"auth file {self.auth_file}: tenant(s) {', '.join(quota_names)} have a memory "
                    "quota, which --eviction-policy s3fifo cannot enforce (it cannot evict one "
                    "tenant's values alone); use --eviction-policy chain or lru, or drop the "
                    "memory quotas (docs/security.md)"
                )

    def master_credentials(self):
        """How this node proves itself to the masters: its auth file's cluster-role token
        (else $GCACHE_TOKEN) and the --master-tls-* files."""
        from gcache.cluster.master_api import MasterCredentials

        token = self.auth.cluster_token() if self.auth else None
        return MasterCredentials.from_env(
            token=token,
            tls_ca=self.master_tls_ca or None,
            tls_cert=self.master_tls_cert or None,
            tls_key=self.master_tls_key or None,
        )

    @property
    def auth(self):
        """The AuthConfig of auth_file (loaded once), or None without one."""
        if not self.auth_file:
            return None
        cached = self.__dict__.get("_auth")
        if cached is None or cached.path != self.auth_file:
            from gcache.wire.auth import AuthFileError, load_auth_file

            try:
                cached = self.__dict__["_auth"] = load_auth_file(self.auth_file)
            except AuthFileError as e:
                raise ConfigError(str(e)) from None
        return cached

    def advertise_address(self, bound_port: int | None = None) -> str:
        """host:port other nodes and clients use to reach this node's data port."""
        if self.advertise:
            return self.advertise
        return f"{self.host}:{bound_port if bound_port is not None else self.port}"

    def node_id_or_default(self, bound_port: int | None = None) -> str:
        return self.node_id or self.advertise_address(bound_port)

    def default_put_reserve_bytes(self) -> int:
        """--memory / 8, but room for two of the largest values, and at most half the memory."""
        return max(1 << 20, min(self.memory // 2, max(self.memory // 8, 2 * self.value_bytes_max)))

    def native_config(self) -> dict:
        """The dict gcache._native.Server(config) takes."""
        return {
            "host": self.host,
            "port": self.port,
            "memory_bytes": self.memory,
            "disk_bytes": self.disk,
            "data_dir": self.data_dir,
            "value_bytes_max": self.value_bytes_max,
            "batch_keys_max": self.batch_keys_max,
            "frame_payload_bytes_max": self.frame_payload_bytes_max,
            "connections_max": self.connections_max,
            "idle_timeout_s": self.idle_timeout_s,
            "connections_per_address_max": self.connections_per_address_max,
            "connections_per_tenant_max": self.connections_per_tenant_max,
            "meta_buffer_bytes_max": self.meta_buffer_bytes_max,
            "put_reserve_bytes_max": self.put_reserve_bytes_max or self.default_put_reserve_bytes(),
            "index_bytes_max": self.index_bytes_max or max(32 << 20, (self.memory + self.disk) // 8),
            "stall_timeout_s": self.stall_timeout_s,
            "segment_bytes": self.segment_bytes,
            "warm_restart": self.warm_restart,
            "tenants": self.auth.native_tenants() if self.auth else None,
            "auth_timeout_s": self.auth_timeout_s,
            "preauth_connections_max": self.preauth_connections_max,
            "preauth_connections_per_address_max": self.preauth_connections_per_address_max,
            "eviction_policy": self.eviction_policy,
            "eviction_fresh_weight": self.eviction_fresh_weight,
            "eviction_ghost_factor": self.eviction_ghost_factor,
            "eviction_tail_hint": self.eviction_tail_hint,
            "small_queue_fraction": self.eviction_small_queue_fraction,
            "disk_exclusive": self.disk_exclusive,
            "unix_socket_path": self.unix_socket_path(),
            "shm_lease_s": self.shm_lease_s,
            "shm_scrub": self.shm_scrub,
            "spin_us": self.spin_us,
            "instance_id": secrets.token_hex(8),
        }

    def unix_socket_path(self) -> str:
        """The --unix-socket path to bind, or "" for none. "auto" puts it in --data-dir
        (absolute, so clients elsewhere can reach it); none where that path would be
        too long for a socket address (108 bytes), or with --disk 0 and no such dir."""
        if self.unix_socket != "auto":
            return os.path.abspath(self.unix_socket) if self.unix_socket else ""
        if not self.data_dir:
            return ""
        path = self._auto_unix_socket_path()
        return path if len(path.encode()) <= UNIX_SOCKET_PATH_BYTES_MAX else ""

    def _auto_unix_socket_path(self) -> str:
        return os.path.abspath(os.path.join(self.data_dir, UNIX_SOCKET_NAME))

    def no_unix_socket_reason(self) -> str:
        """Why same-host clients get no shared memory from this node ("" when they do), with
        what to change: `Client(transport="auto")` then uses TCP."""
        if self.auth_file:
            return (
                "--auth-file is set and the arena holds every tenant's values, so shared memory "
                "is refused; same-host clients use TCP (docs/security.md)"
            )
        if self.unix_socket == "":
            return "--unix-socket '' turns the Unix socket off; same-host clients use TCP"
        if self.unix_socket == "auto" and not self.data_dir:
            return "no --data-dir for the Unix socket; pass --unix-socket PATH, or same-host clients use TCP"
        if self.unix_socket == "auto" and not self.unix_socket_path():
            path = self._auto_unix_socket_path()
            return (
                f"the socket path {path} is {len(path.encode())} bytes, over the "
                f"{UNIX_SOCKET_PATH_BYTES_MAX} a Unix socket allows; pass a shorter --unix-socket "
                "PATH, or same-host clients use TCP"
            )
        return ""

    def as_dict(self) -> dict:
        return asdict(self)


_SIZE_FIELDS = {f.name for f in fields(ServerSettings) if (fl := flag_of(f)) is not None and fl.size}
UNIX_SOCKET_NAME = "gcache.sock"
UNIX_SOCKET_PATH_BYTES_MAX = 107  # sockaddr_un.sun_path, less its NUL
_WILDCARD_HOSTS = ("0.0.0.0", "::", "", "[::]")
REBALANCE_BATCH_BYTES_MIN = 1 << 20
REBALANCE_BATCH_BYTES_MAX = 1 << 30
HEARTBEAT_INTERVAL_S_MIN = 0.05
HEARTBEAT_INTERVAL_S_MAX = 60.0

EPILOG = """\
sizes accept bytes or a unit: KiB MiB GiB TiB (powers of 2), KB MB GB TB (powers of 10).

config file: TOML; any flag above by its name (dashes or underscores), e.g.
  memory = "8GiB"
  data-dir = "/var/lib/gcache"
command-line flags override the file.

cluster: with --master the node registers with the gcache-master replicas,
heartbeats, and moves keys to their owners when the map changes
(docs/cluster.md). POST /drain on the admin port, the file DATA_DIR/DRAIN,
disk errors or (with --memory-pressure-drain) sustained NO_SPACE refusals make
the node drain itself; once drained and removed from the map it exits 0.

signals: SIGTERM / SIGINT stop gracefully: requests already received finish, the
memory tier is written to disk (a restart comes back warm), then exit 0.

exit codes:
  0  clean stop, or left the cluster after a completed drain
  1  internal error
  2  usage or configuration error (bad flag, bad value, unreadable config file, a data
     dir other users may read or write, an auth file others may write)
  3  cannot serve: port already in use, data dir locked or unusable
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gcache-server",
        description="GCache node: a memory + disk KV-cache store served over TCP (docs/protocol.md).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (command-line flags win)")
    # Defaults are None so the config file can fill what the command line left out.
    add_flags(p, ServerSettings, defaults=False)
    return p


def _read_config_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    known = {f.name for f in fields(ServerSettings)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown key {key!r}; see gcache-server --help")
        out[name] = value
    return out


def _coerce(name: str, value, kind) -> object:
    try:
        if name in _SIZE_FIELDS:
            return parse_size(value)
        if kind is bool or kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, not {value!r}")
            return value
        if kind in (int, "int"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, not {value!r}")
            return value
        if kind in (float, "float"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, not {value!r}")
            return float(value)
        return None if value is None else str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: {e}") from e


def _validate(s: ServerSettings) -> None:
    checks = [
        (0 <= s.port <= 65535, "--port must be 0..65535"),
        (0 <= s.admin_port <= 65535, "--admin-port must be 0..65535"),
        (0 <= s.grpc_port <= 65535, "--grpc-port must be 0..65535"),
        (s.memory >= 1 << 20, "--memory must be at least 1MiB"),
        (s.value_bytes_max >= 1, "--value-bytes-max must be at least 1 byte"),
        (s.value_bytes_max <= s.frame_payload_bytes_max, "--value-bytes-max must not exceed --frame-payload-bytes-max"),
        (1 <= s.batch_keys_max <= 1 << 20, "--batch-keys-max must be 1..1048576"),
        (1 <= s.connections_max <= 1 << 20, "--connections-max must be 1..1048576"),
        (0 <= s.connections_per_address_max <= 1 << 20, "--connections-per-address-max must be 0..1048576"),
        (0 <= s.connections_per_tenant_max <= 1 << 20, "--connections-per-tenant-max must be 0..1048576"),
        (s.meta_buffer_bytes_max >= 1 << 20, "--meta-buffer-bytes-max must be at least 1MiB"),
        (s.index_bytes_max == 0 or s.index_bytes_max >= 1 << 20, "--index-bytes-max must be at least 1MiB"),
        (
            s.put_reserve_bytes_max == 0 or s.put_reserve_bytes_max >= 1 << 20,
            "--put-reserve-bytes-max must be at least 1MiB (0 = --memory / 8)",
        ),
        (s.idle_timeout_s > 0, "--idle-timeout-s must be positive"),
        (s.stall_timeout_s > 0, "--stall-timeout-s must be positive"),
        (s.shutdown_grace_s >= 0, "--shutdown-grace-s must not be negative"),
        (0 < s.shm_lease_s <= 3600, "--shm-lease-s must be in (0, 3600]"),
        (0 <= s.spin_us <= 10_000, "--spin-us must be in [0, 10000]"),
        (
            s.unix_socket == "auto"
            or len(os.path.abspath(s.unix_socket).encode()) <= UNIX_SOCKET_PATH_BYTES_MAX
            or not s.unix_socket,
            f"--unix-socket path must be at most {UNIX_SOCKET_PATH_BYTES_MAX} bytes",
        ),
        (s.segment_bytes >= 1 << 20, "--segment-bytes must be at least 1MiB"),
        (bool(s.data_dir) or s.disk == 0, "--data-dir is required unless --disk 0"),
        (s.log_level in LOG_LEVELS, "log_level must be debug|info|warning|error"),
        (0 < s.auth_timeout_s <= 300, "--auth-timeout-s must be in (0, 300]"),
        (1 <= s.preauth_connections_max <= 1 << 20, "--preauth-connections-max must be 1..1048576"),
        (
            1 <= s.preauth_connections_per_address_max <= 1 << 20,
            "--preauth-connections-per-address-max must be 1..1048576",
        ),
        (s.eviction_policy in EVICTION_POLICIES, f"--eviction-policy must be one of {', '.join(EVICTION_POLICIES)}"),
        (
            s.eviction_fresh_weight == 0 or 1 <= s.eviction_fresh_weight <= 64,
            "--eviction-fresh-weight must be 0 (tuned online) or in [1, 64]",
        ),
        (0 <= s.eviction_ghost_factor <= 16, "--eviction-ghost-factor must be in [0, 16]"),
        (0.01 <= s.eviction_small_queue_fraction <= 0.9, "--eviction-small-queue-fraction must be in [0.01, 0.9]"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _validate_cluster(s)
    if s.auth_file:
        auth = s.auth  # ConfigError if unreadable or invalid
        if s.master:
            from gcache.wire.auth import AuthFileError

            try:
                auth.cluster_token()  # a cluster node needs the cluster role's token
            except AuthFileError as e:
                raise ConfigError(str(e)) from None


def _is_host_port(text: str) -> bool:
    try:
        parse_host_port(text)
    except ValueError:
        return False
    return True


def _validate_cluster(s: ServerSettings) -> None:
    if s.advertise and not _is_host_port(s.advertise):
        raise ConfigError(f"--advertise {s.advertise!r} is not host:port")
    if s.advertise and parse_host_port(s.advertise)[0] in _WILDCARD_HOSTS:
        raise ConfigError(f"--advertise {s.advertise!r} must name a reachable address, not a wildcard")
    if s.node_id and not 0 < len(s.node_id.encode()) <= 128:
        raise ConfigError("--node-id must be 1..128 bytes")
    if not HEARTBEAT_INTERVAL_S_MIN <= s.heartbeat_interval_s <= HEARTBEAT_INTERVAL_S_MAX:
        raise ConfigError(
            f"--heartbeat-interval-s must be {HEARTBEAT_INTERVAL_S_MIN}..{HEARTBEAT_INTERVAL_S_MAX:g} seconds"
        )
    if not REBALANCE_BATCH_BYTES_MIN <= s.rebalance_batch_bytes <= REBALANCE_BATCH_BYTES_MAX:
        raise ConfigError("--rebalance-batch-bytes must be 1MiB..1GiB")
    if not 0.0 <= s.memory_pressure_drain < 1.0:
        raise ConfigError("--memory-pressure-drain must be a fraction in [0, 1); 0 turns it off")
    if bool(s.master_tls_cert) != bool(s.master_tls_key):
        raise ConfigError("--master-tls-cert and --master-tls-key go together")
    if s.master_tls_cert and not s.master_tls_ca:
        raise ConfigError("--master-tls-cert needs --master-tls-ca (the CA that signed the masters' certificates)")
    if not s.master:
        return
    for address in s.master.removeprefix("gcache://").split(","):
        if not _is_host_port(address.strip()):
            raise ConfigError(
                f"--master: {address.strip()!r} is not host:port; "
                "give HOST:PORT[,HOST:PORT...] of the gcache-master replicas"
            )
    if not s.advertise and s.host in _WILDCARD_HOSTS:
        raise ConfigError(
            f"--host {s.host} listens on every interface: with --master, give "
            "--advertise HOST:PORT, the address other nodes and clients should use"
        )


def load_settings(argv: list[str] | None = None) -> ServerSettings:
    """Parses argv (argparse exits 2 on a bad flag) and merges the config file.

    Raises ConfigError for bad values.
    """
    args = build_parser().parse_args(argv)
    merged: dict = {}
    if args.config:
        merged.update(_read_config_file(args.config))
    for name, value in vars(args).items():
        if name != "config" and value is not None:
            merged[name] = value
    settings = ServerSettings()
    types = {f.name: f.type for f in fields(ServerSettings)}
    for name, value in merged.items():
        kind = types[name]
        if name in (
            "admin_host",
            "master",
            "node_id",
            "advertise",
            "auth_file",
            "master_tls_ca",
            "master_tls_cert",
            "master_tls_key",
        ):
            kind = str
        setattr(settings, name, _coerce(name, value, kind))
    _validate(settings)
    return settings
