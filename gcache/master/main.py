"""gcache-master: one replica of the Raft-replicated control plane.

  gcache-master --grpc 10.0.0.1:7700 --raft 10.0.0.1:7701 \\
                --peers 10.0.0.2:7701,10.0.0.3:7701 --data-dir /var/lib/gcache-master

Run 1, 3 or 5 replicas, each with the others' Raft addresses in --peers. Exit
status: 0 after SIGTERM/SIGINT, 2 on bad arguments, 3 when a port cannot be bound.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import sys
import threading

from gcache.cluster.master_api import MASTERS_MAX
from gcache.common.address import parse_host_port
from gcache.common.file_modes import PRIVATE_DIR_MODE, private_umask, secret_file_problems

log = logging.getLogger("gcache.master")

EXIT_OK, EXIT_USAGE, EXIT_BIND = 0, 2, 3
LOCK_FILE = "gcache-master.lock"


class UsageError(Exception):
    pass


def _host_port(text: str, flag: str) -> tuple[str, int]:
    try:
        return parse_host_port(text.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:7700") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gcache-master",
        description="GCache master: keeps the cluster map (membership, epochs, heartbeats, drains), "
        "replicated with Raft over 1/3/5 replicas. Never on the data path.",
    )
    p.add_argument(
        "--grpc",
        default="127.0.0.1:7700",
        metavar="HOST:PORT",
        help="address of the gcache.Master gRPC API (default %(default)s)",
    )
    p.add_argument(
        "--raft",
        default="127.0.0.1:7701",
        metavar="HOST:PORT",
        help="this replica's Raft address, exactly as the other replicas list it in "
        "their --peers (default %(default)s)",
    )
    p.add_argument(
        "--raft-bind",
        default="",
        metavar="HOST:PORT",
        help="address to bind for Raft when it differs from --raft (e.g. 0.0.0.0:7701 "
        "behind NAT or Kubernetes DNS names); default: exactly --raft's host and port",
    )
    p.add_argument(
        "--peers",
        default="",
        metavar="RAFT_ADDR[,RAFT_ADDR...]",
        help="the OTHER replicas' Raft addresses; empty = a single replica",
    )
    p.add_argument(
        "--data-dir",
        default="./gcache-master-data",
        metavar="DIR",
        help="Raft journal and full dump (created if missing; default %(default)s)",
    )
    p.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=5.0,
        help="a node without a heartbeat for this long becomes dead (default %(default)s)",
    )
    p.add_argument(
        "--migration-timeout-s",
        type=float,
        default=120.0,
        help="a join or drain ends after at most this long (default %(default)s)",
    )
    p.add_argument("--tick-s", type=float, default=0.2, help="period of the leader's duties (default %(default)s)")
    p.add_argument(
        "--http", default="", metavar="HOST:PORT", help="probe endpoint: GET /healthz, /readyz, /map (default: off)"
    )
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default %(default)s)"
    )
    security = p.add_argument_group("security (docs/security.md)")
    security.add_argument(
        "--tls-cert",
        metavar="PEM",
        default="",
        help="serve the gRPC API over TLS with this certificate (chain); needs --tls-key",
    )
    security.add_argument("--tls-key", metavar="PEM", default="", help="private key of --tls-cert")
    security.add_argument(
        "--tls-ca",
        metavar="PEM",
        default="",
        help="with --tls-cert: also require client certificates signed by this CA "
        "(mutual TLS; default: server TLS only)",
    )
    security.add_argument(
        "--auth-file",
        metavar="FILE",
        default="",
        help="tenants file (as gcache-server's): every call needs a bearer token; "
        "Register/Heartbeat the cluster role, Drain admin or cluster, Remove admin, "
        "Status admin or cluster, GetMap any (default: no tokens)",
    )
    return p


def validate(args) -> dict:
    """Checks the arguments; returns the derived values. Raises UsageError with what to fix."""
    _host_port(args.grpc, "--grpc")
    _host_port(args.raft, "--raft")
    if args.raft_bind:
        _host_port(args.raft_bind, "--raft-bind")
    if args.http:
        _host_port(args.http, "--http")
    peers = [a.strip() for a in args.peers.split(",") if a.strip()]
    for peer in peers:
        _host_port(peer, "--peers")
    if len(set(peers)) != len(peers):
        raise UsageError(f"--peers lists an address twice: {args.peers!r}")
    peers = [peer for peer in peers if peer != args.raft]  # one shared list for every replica is fine
    if len(peers) + 1 > MASTERS_MAX:
        raise UsageError(f"at most {MASTERS_MAX} replicas; --peers names {len(peers)} others")
    if args.grpc == args.raft or (args.http and args.http in (args.grpc, args.raft)):
        raise UsageError("--grpc, --raft and --http need different addresses")
    for flag, value in (
        ("--heartbeat-timeout-s", args.heartbeat_timeout_s),
        ("--migration-timeout-s", args.migration_timeout_s),
        ("--tick-s", args.tick_s),
    ):
        if not value > 0 or value != value or value == float("inf"):
            raise UsageError(f"{flag} must be a positive number of seconds, got {value}")
    if args.tick_s >= args.heartbeat_timeout_s:
        raise UsageError(
            f"--tick-s ({args.tick_s}) must be shorter than --heartbeat-timeout-s "
            f"({args.heartbeat_timeout_s}), or dead nodes are noticed late"
        )
    if not args.data_dir:
        raise UsageError("--data-dir must name a directory")
    return {"peers": peers}


def _tls(args):
    """(cert, key, client CA or None) PEM bytes, or None without --tls-cert."""
    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together (and --tls-ca needs both)")
    out: list[bytes | None] = []
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca)):
        if not path:
            out.append(None)
            continue
        try:
            with open(path, "rb") as f:
                out.append(f.read())
        except OSError as e:
            raise UsageError(f"{flag} {path}: {e.strerror}") from None
    return tuple(out)


def _auth(args):
    if not args.auth_file:
        return None
    from gcache.wire.auth import AuthFileError, load_auth_file, placeholder_tenants

    try:
        auth = load_auth_file(args.auth_file)
    except AuthFileError as e:
        raise UsageError(str(e)) from None
    names = placeholder_tenants(auth)
    if names:
        raise UsageError(
            f"auth file {args.auth_file}: tenant(s) {', '.join(names)} still have the example's "
            "placeholder token; generate real ones (docs/security.md)"
        )
    problems = secret_file_problems(args.auth_file)
    if problems.error:
        raise UsageError(problems.error)
    if problems.warning:
        log.warning("%s (it holds the tokens)", problems.warning)
    return auth


def _lock_data_dir(data_dir: str):
    """Creates the dir and holds a lock in it: two replicas on one journal would corrupt it."""
    try:
        os.makedirs(data_dir, mode=PRIVATE_DIR_MODE, exist_ok=True)
        lock = open(os.path.join(data_dir, LOCK_FILE), "a")
    except OSError as e:
        raise UsageError(f"--data-dir {data_dir!r}: {e.strerror or e}; give a writable directory") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise UsageError(
            f"--data-dir {data_dir!r} is in use by another gcache-master; give each replica its own directory"
        ) from None
    return lock


def main(argv=None) -> int:
    """The journal and everything else it writes: 0600 / 0700, whatever the umask it was
    started with (restored on return, for callers in the same process)."""
    previous_umask = private_umask()
    try:
        return _main(argv)
    finally:
        os.umask(previous_umask)


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        derived = validate(args)
        derived.update(tls=_tls(args), auth=_auth(args))
    except UsageError as e:
        print(f"gcache-master: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    try:
        lock = _lock_data_dir(args.data_dir)
    except UsageError as e:
        print(f"gcache-master: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _serve(args, derived, stop)
    finally:
        lock.close()


def _serve(args, derived: dict, stop: threading.Event) -> int:
    peers = derived["peers"]
    # Imported here so that `--help` and argument errors stay fast.
    from pysyncobj.syncobj import SyncObjException

    from gcache.master.http_probe import HttpProbe
    from gcache.master.leader_duties import LeaderDuties
    from gcache.master.raft_state import MasterRaft, ReplicatedMap
    from gcache.master.service import MasterGrpcServer, MasterService

    replicas = len(peers) + 1
    log.info(
        "gcache-master starting: grpc=%s raft=%s%s peers=[%s] (%d replica%s, quorum %d) data_dir=%s "
        "heartbeat_timeout_s=%s migration_timeout_s=%s tick_s=%s http=%s tls=%s auth=%s",
        args.grpc,
        args.raft,
        f" (bind {args.raft_bind})" if args.raft_bind else "",
        ",".join(peers),
        replicas,
        "" if replicas == 1 else "s",
        replicas // 2 + 1,
        os.path.abspath(args.data_dir),
        args.heartbeat_timeout_s,
        args.migration_timeout_s,
        args.tick_s,
        args.http or "off",
        ("mutual" if args.tls_ca else "on") if args.tls_cert else "off",
        f"on ({len(derived['auth'].tenants)} tenants)" if derived["auth"] else "off",
    )
    if derived["auth"] and not args.tls_cert:
        log.warning(
            "--auth-file without --tls-cert: bearer tokens cross the network in clear text; "
            "give the masters a certificate (docs/security.md)"
        )
    if replicas % 2 == 0:
        log.warning(
            "%d replicas tolerate no more failures than %d; run an odd number (1, 3, 5)", replicas, replicas - 1
        )

    def on_change(change: str, new_map) -> None:
        log.info("map epoch %d: %s", new_map.epoch, change)

    replicated_map = ReplicatedMap(on_change=on_change)
    # Exactly --raft's address unless --raft-bind says otherwise (pysyncobj alone binds 0.0.0.0).
    raft = MasterRaft(args.raft, peers, args.data_dir, replicated_map, bind_address=args.raft_bind or args.raft)
    try:
        raft.waitBinded()
    except SyncObjException:
        raft.close()
        print(
            f"gcache-master: error: cannot listen for Raft on {args.raft_bind or args.raft}: address in use "
            "or not local; pick another --raft HOST:PORT (or --raft-bind)",
            file=sys.stderr,
        )
        return EXIT_BIND
    grpc_server = http = None
    duties = LeaderDuties(raft, args.heartbeat_timeout_s, args.migration_timeout_s, args.tick_s)
    try:
        try:
            grpc_server = MasterGrpcServer(args.grpc, MasterService(raft, derived["auth"]), tls=derived["tls"])
            if args.http:
                host, port = _host_port(args.http, "--http")
                http = HttpProbe(host, port, leader=raft.leader, map_dict=lambda: replicated_map.map.to_dict())
        except OSError as e:
            print(f"gcache-master: error: {e}", file=sys.stderr)
            return EXIT_BIND
        grpc_server.start()
        if http is not None:
            http.start()
        duties.start()
        log.info(
            "gcache-master ready to serve on %s (map epoch %d so far; waiting for a Raft leader)",
            args.grpc,
            replicated_map.map.epoch,
        )
        while not stop.wait(1.0):
            pass
        log.info("stopping on signal")
        return EXIT_OK
    finally:
        if http is not None:
            http.stop()
        if grpc_server is not None:
            grpc_server.stop(grace_s=0.5)
        duties.stop()
        raft.close()
        log.info("stopped (map epoch %d)", replicated_map.map.epoch)


if __name__ == "__main__":
    sys.exit(main())
