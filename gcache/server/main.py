"""gcache-server: runs one GCache node until SIGTERM / SIGINT.

The native core (gcache._native.Server) serves the data protocol on its own
threads; this process configures it, serves the admin endpoints, and on a
signal stops it gracefully and flushes the memory tier to disk. With --master
a cluster agent (gcache.server.cluster_agent) also runs; after a completed
drain it stops the node the same way and the process exits 0.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gcache import __version__
from gcache.common.address import join_host_port, parse_host_port
from gcache.common.file_modes import FileModeError, prepare_private_dir, private_umask, secret_file_problems
from gcache.common.host_checks import HostNeeds, run_checks, warning_lines
from gcache.common.host_checks import gauges as host_gauges
from gcache.server.config import (
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ConfigError,
    ServerSettings,
    load_settings,
)
from gcache.wire.rdma_verbs import RdmaUnavailable

if TYPE_CHECKING:  # imported late below (grpc, the native build): for annotations only
    from gcache.server.admin_grpc import AdminGrpcServer
    from gcache.server.admin_http import AdminHttpServer
    from gcache.server.cluster_agent import ClusterAgent
    from gcache.server.rdma import RdmaRegion

log = logging.getLogger("gcache.server")

# Written into --data-dir when a drain completes. A restarted process (a
# DaemonSet or a supervisor restarts exited containers) then stays out of the
# cluster instead of registering again; delete the file to let it rejoin.
DRAINED_MARKER = "DRAINED"


def drained_marker(settings: ServerSettings) -> Path | None:
    return Path(settings.data_dir) / DRAINED_MARKER if settings.data_dir else None


class Node:
    """The running node: native server plus optional admin servers."""

    def __init__(self, settings: ServerSettings):
        from gcache import _native  # imported late so --help works without the build

        self.settings = settings
        self.stopping = threading.Event()
        self.native: Any = None  # gcache._native.Server (a compiled module: untyped), set below
        self.admin_http: AdminHttpServer | None = None
        self.admin_grpc: AdminGrpcServer | None = None
        self.agent: ClusterAgent | None = None  # ClusterAgent with --master, started once the data port listens
        self.rdma: RdmaRegion | None = None  # gcache.server.rdma.RdmaRegion with --rdma-device
        self.parked = False  # drained earlier (DRAINED marker): up, but out of the cluster
        self.host_gauges: dict[str, int] = {}  # the host checks' results (gcache.common.host_checks)
        # Before the store opens (which can take a while): a missing device fails at once.
        rdma_device = None
        if settings.rdma_device:
            from gcache.server.rdma import open_device

            rdma_device = open_device(settings.rdma_device)  # RdmaUnavailable
        try:
            _prepare_data_dir(settings)  # before the Unix socket and the store
        except BaseException:
            if rdma_device is not None:
                rdma_device.close()
            raise
        # Admin ports bind first: once the data port accepts, everything is up.
        try:
            admin_host = settings.admin_host or settings.host
            if settings.admin_port:
                from gcache.server.admin_http import AdminHttpServer

                self.admin_http = AdminHttpServer(
                    admin_host,
                    settings.admin_port,
                    self.stats,
                    self.flush,
                    self.ready,
                    cluster=self.cluster_status,
                    drain=self.request_drain,
                    auth=settings.auth,
                )
            if settings.grpc_port:
                from gcache.server.admin_grpc import AdminGrpcServer

                self.admin_grpc = AdminGrpcServer(
                    admin_host, settings.grpc_port, self.stats, self.flush, auth=settings.auth
                )
            config = settings.native_config()
            config["version"] = __version__
            self.native = _native.Server(config)
            if rdma_device is not None:
                from gcache.server.rdma import RdmaRegion

                self.rdma = RdmaRegion(self.native, rdma_device)
        except BaseException:
            self._close_admin()
            if rdma_device is not None and self.rdma is None:
                rdma_device.close()
            raise

    def stats(self) -> dict:
        stats = self.native.stats()
        stats.setdefault("gauges", {}).update(self.host_gauges)  # gcache_host_check_<name>
        agent = self.agent
        if agent is not None:  # rebalance counters and cluster gauges beside the native ones
            for section, values in agent.metrics().items():
                stats.setdefault(section, {}).update(values)
        return stats

    def cluster_status(self) -> dict | None:
        """GET /cluster: the agent's view, or None for a standalone node."""
        return self.agent.status() if self.agent is not None else None

    def request_drain(self, reason: str) -> dict | None:
        """POST /drain: None for a standalone node (nothing to drain into)."""
        return self.agent.request_drain(reason) if self.agent is not None else None

    def flush(self) -> None:
        self.native.flush()

    def _close_admin(self) -> None:
        if self.admin_grpc:
            self.admin_grpc.close()
        if self.admin_http:
            self.admin_http.close()

    def ready(self) -> bool:
        return not self.stopping.is_set() and not self.parked

    def start(self, on_drained=lambda: None) -> None:
        self.native.start()
        marker = drained_marker(self.settings)
        if self.settings.master and marker is not None and marker.exists():
            self.parked = True
            log.warning(
                "this node was drained (%s exists): not joining the cluster, /readyz answers "
                "503; delete that file and restart to rejoin",
                marker,
            )
        elif self.settings.master:
            from gcache.server.cluster_agent import ClusterAgent

            admin = ""
            if self.admin_http:
                admin_host = self.settings.admin_host or self.settings.host
                if admin_host in ("0.0.0.0", "::", ""):
                    admin_host = parse_host_port(self.settings.advertise_address(self.native.port))[0]
                admin = join_host_port(admin_host, self.admin_http.port)
            self.agent = ClusterAgent(
                self.settings,
                self.native,
                bound_port=self.native.port,
                admin_address=admin,
                stats=self.native.stats,
                on_drained=on_drained,
            )
        if self.admin_http:
            self.admin_http.start()
        if self.admin_grpc:
            self.admin_grpc.start()
        if self.agent is not None:
            self.agent.start()

    def shutdown(self) -> None:
        """Graceful stop: finish requests in flight, then write memory to disk."""
        self.stopping.set()
        if self.agent is not None:
            self.agent.stop()  # no heartbeats or pushes while the data port closes
        log.info("stopping: finishing requests in flight (grace %.1fs)", self.settings.shutdown_grace_s)
        self.native.stop(self.settings.shutdown_grace_s)
        if self.rdma is not None:
            self.rdma.close()
        if self.settings.disk:
            log.info("flushing the memory tier to %s", self.settings.data_dir)
            self.native.flush()
        else:
            log.info("no disk tier (--disk 0): memory contents are not kept")
        self._close_admin()
        log.info("stopped cleanly")


class DataDirUnusable(Exception):
    """--data-dir cannot be created."""


def _prepare_data_dir(settings: ServerSettings) -> None:
    """Creates the data dir 0700 where it is missing (also with --disk 0: the Unix socket lives
    there); FileModeError when other users may read or write an existing one."""
    if not settings.data_dir:
        return
    try:
        if prepare_private_dir(settings.data_dir):
            log.info("created the data dir %s (mode 0700)", settings.data_dir)
    except OSError as e:
        raise DataDirUnusable(f"cannot create --data-dir {settings.data_dir}: {e.strerror or e}") from None


def host_needs(settings: ServerSettings) -> HostNeeds:
    """What the host checks compare against: the arena, RDMA registration, the connection caps."""
    return HostNeeds(
        arena_bytes=settings.memory,
        rdma=bool(settings.rdma_device),
        connections=settings.connections_max + (settings.preauth_connections_max if settings.auth_file else 0),
    )


def _write_drained_marker(settings: ServerSettings) -> None:
    marker = drained_marker(settings)
    if marker is None:
        log.warning("drain complete: no --data-dir, so a restart of this process joins again")
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(
            f"drained at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; "
            "delete this file to let the node rejoin the cluster\n"
        )
    except OSError as e:
        log.error("drain complete, but writing %s failed (%s): a restart would join again", marker, e)
        return
    log.info("drain complete: this node left the cluster; stopping (a restart stays out: %s)", marker)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(settings: ServerSettings) -> int:
    """Serves until a signal (or a completed drain); returns the exit code. Every file and
    directory the node creates meanwhile is 0600 / 0700, whatever the umask it was started
    with (restored on return, for callers in the same process)."""
    previous_umask = private_umask()
    try:
        return _run(settings)
    finally:
        os.umask(previous_umask)


def _run(settings: ServerSettings) -> int:
    from gcache import _native

    log.info("config %s", json.dumps(settings.as_dict(), sort_keys=True))
    if settings.auth_file:
        log.info("authentication on: %d tenants from %s", len(settings.auth.tenants), settings.auth_file)
        problems = secret_file_problems(settings.auth_file)
        if problems.error:
            log.error("%s", problems.error)
            return EXIT_USAGE
        if problems.warning:
            log.warning("%s (it holds the tokens)", problems.warning)
    elif settings.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "no --auth-file and --host %s: anyone who can reach port %d can read, overwrite and "
            "remove every key (docs/security.md)",
            settings.host,
            settings.port,
        )
    if settings.rdma_device and settings.auth_file:
        log.error(
            "--rdma-device with --auth-file: RDMA would reach every tenant's values in the arena, so a "
            "node with authentication refuses it; drop one of the two"
        )
        return EXIT_USAGE
    no_socket = settings.no_unix_socket_reason()
    if no_socket:
        log.warning("no shared memory for same-host clients: %s", no_socket)
    host = run_checks(host_needs(settings))
    for line in warning_lines(host):
        log.warning("%s", line)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    # Installed before the store opens (which can take a while), so a signal
    # during start-up still ends in a clean stop.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        node = Node(settings)
    except FileModeError as e:
        log.error("%s", e)
        return EXIT_USAGE
    except DataDirUnusable as e:
        log.error("%s", e)
        return EXIT_UNAVAILABLE
    except _native.StoreOpenError as e:
        log.error("%s; check --data-dir exists, is writable and no other gcache-server uses it", e)
        return EXIT_UNAVAILABLE
    except (_native.BindError, OSError) as e:
        log.error("cannot listen: %s", e)
        return EXIT_UNAVAILABLE
    except RdmaUnavailable as e:
        log.error("--rdma-device %s: %s", settings.rdma_device, e)
        return EXIT_UNAVAILABLE

    drained = threading.Event()

    def on_drained():
        drained.set()
        stop.set()

    node.host_gauges = host_gauges(host)
    node.start(on_drained)
    admin = f", admin http :{node.admin_http.port}" if node.admin_http else ""
    admin += f", admin grpc :{node.admin_grpc.port}" if node.admin_grpc else ""
    log.info("gcache-server %s serving on %s:%d%s", __version__, settings.host, node.native.port, admin)
    while not stop.wait(0.5):  # short waits keep signal handling prompt
        pass
    if drained.is_set():
        _write_drained_marker(settings)
    node.shutdown()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
        settings.check_files()
    except ConfigError as e:
        print(f"gcache-server: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    _setup_logging(settings.log_level)
    try:
        return run(settings)
    except Exception:  # noqa: BLE001 -- last resort: log it and use the documented exit code
        log.exception("internal error; please report it with this log")
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
