"""`gcache admin`: cluster commands against the gcache-master replicas.

  gcache admin [--master URL] map [--json]        the cluster map as a table
  gcache admin [--master URL] status [--json]     map, Raft state, heartbeat ages
  gcache admin [--master URL] drain NODE [--wait [--timeout-s S]]
  gcache admin [--master URL] remove NODE

URL: gcache://h:p,h:p or h:p,h:p; default $GCACHE_MASTER. Exit codes are the
CLI's: 0 ok, 1 unknown node, 2 usage, 4 no master answered, 5 other errors
(a refused state change, a drain that did not finish within --timeout-s).
"""

from __future__ import annotations

import json
import os
import sys
import time

DRAIN_WAIT_POLL_S = 0.25
DRAIN_WAIT_TIMEOUT_S = 300.0
COLUMNS = ("id", "address", "weight", "state", "changed_epoch", "admin")


def add_parser(sub) -> None:
    """Adds the `admin` command to the main CLI's subparsers."""
    admin = sub.add_parser(
        "admin", help="cluster commands against the gcache-master replicas", description=__doc__.split("\n\n")[0]
    )
    admin.add_argument(
        "--master",
        default=os.environ.get("GCACHE_MASTER", ""),
        help="masters as gcache://h:p,h:p or h:p,h:p (default: $GCACHE_MASTER)",
    )
    admin.add_argument(
        "--tls-ca",
        default=os.environ.get("GCACHE_MASTER_TLS_CA", ""),
        metavar="PEM",
        help="CA of the masters' TLS certificates (default: $GCACHE_MASTER_TLS_CA; "
        "none: plaintext); the token comes from --token-file or $GCACHE_TOKEN",
    )
    cmds = admin.add_subparsers(dest="admin_command", required=True, metavar="ADMIN_COMMAND")
    cmap = cmds.add_parser("map", help="print the cluster map (id, address, weight, state, ...)")
    cmap.add_argument("--json", action="store_true", help="print the map as one JSON object")
    status = cmds.add_parser("status", help="print the master's status: map, Raft, heartbeat ages")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    drain = cmds.add_parser("drain", help="start draining NODE: it pushes its keys away, then leaves")
    drain.add_argument("node", metavar="NODE")
    drain.add_argument("--wait", action="store_true", help="wait until NODE has left the map")
    drain.add_argument(
        "--timeout-s",
        dest="wait_timeout_s",
        type=float,
        default=DRAIN_WAIT_TIMEOUT_S,
        help="with --wait, give up after this many seconds (default: %(default)s)",
    )
    remove = cmds.add_parser("remove", help="remove NODE from the map at once (no drain)")
    remove.add_argument("node", metavar="NODE")


def _table(cmap) -> str:
    rows = [COLUMNS] + [tuple(str(getattr(n, c)) for c in COLUMNS) for n in cmap.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [f"epoch {cmap.epoch}, {len(cmap.nodes)} node(s)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _drain_wait(client, node_id: str, timeout_s: float) -> bool:
    """Prints each state change of `node_id` until it leaves the map; False on timeout."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout_s:
        cmap = client.get_map()
        node = cmap.node(node_id) if cmap is not None else None
        elapsed = time.monotonic() - start
        if node is None:
            print(f"{node_id} left the map at epoch {cmap.epoch if cmap else '?'} after {elapsed:.1f}s: drain complete")
            return True
        if node.state != last:
            print(f"{elapsed:6.1f}s  epoch {cmap.epoch}: {node_id} is {node.state}")
            last = node.state
        time.sleep(DRAIN_WAIT_POLL_S)
    print(
        f"gcache: {node_id} was still in the map after {timeout_s:g}s; it may still be pushing "
        "its keys (see its log or GET /cluster on its admin port), or the master's "
        "--migration-timeout-s is longer",
        file=sys.stderr,
    )
    return False


def _run(args, client, codes) -> int:
    from gcache.cluster.cluster_map import ClusterMap

    cmd = args.admin_command
    if cmd == "map":
        cmap = client.get_map() or ClusterMap.empty()
        print(json.dumps(cmap.to_dict(), sort_keys=True) if args.json else _table(cmap))
        return codes.EXIT_OK
    if cmd == "status":
        answer = client.call("Status", {})
        if args.json:
            print(json.dumps(answer, sort_keys=True, default=str))
            return codes.EXIT_OK
        cmap = ClusterMap.from_dict(answer["map"]) if answer.get("map") else ClusterMap.empty()
        print(_table(cmap))
        raft = answer.get("raft") or {}
        if raft:
            print("raft:")
            for name in sorted(raft):
                print(f"  {name}: {raft[name]}")
        ages = answer.get("heartbeat_age_s") or {}
        if ages:
            print("heartbeat age (s):")
            for node_id in sorted(ages):
                age = ages[node_id]
                print(f"  {node_id}: {age:.2f}" if isinstance(age, (int, float)) else f"  {node_id}: {age}")
        return codes.EXIT_OK
    if cmd == "drain":
        answer = client.call("Drain", {"node_id": args.node})
        cmap = ClusterMap.from_dict(answer["map"]) if answer.get("map") else None
        node = cmap.node(args.node) if cmap else None
        print(f"{args.node}: {node.state if node else 'not in the map'} at epoch {cmap.epoch if cmap else '?'}")
        if args.wait and not _drain_wait(client, args.node, args.wait_timeout_s):
            return codes.EXIT_ERROR
        return codes.EXIT_OK
    if cmd == "remove":
        answer = client.call("Remove", {"node_id": args.node})
        epoch = answer.get("map", {}).get("epoch", "?") if isinstance(answer.get("map"), dict) else "?"
        print(f"{args.node} removed from the map (epoch {epoch})")
        return codes.EXIT_OK
    raise AssertionError(cmd)


def main(args, codes) -> int:
    """Runs `gcache admin ...`; `codes` is the CLI module (its EXIT_* constants)."""
    import grpc

    from gcache import errors
    from gcache.cluster.master_api import MasterClient, MasterCredentials, MasterUnavailableError
    from gcache.wire.auth import read_token_file

    if not args.master:
        print(
            "gcache admin: no masters: pass --master gcache://HOST:PORT[,HOST:PORT...] or set $GCACHE_MASTER",
            file=sys.stderr,
        )
        return codes.EXIT_USAGE
    try:
        token = read_token_file(args.token_file) if getattr(args, "token_file", None) else None
        credentials = MasterCredentials.from_env(token=token, tls_ca=args.tls_ca or None)
        client = MasterClient(args.master, timeout_s=args.timeout_s, credentials=credentials)
    except (errors.InvalidArgumentError, ValueError) as e:
        print(f"gcache admin: {e}", file=sys.stderr)
        return codes.EXIT_USAGE
    try:
        return _run(args, client, codes)
    except MasterUnavailableError as e:
        print(f"gcache admin: {e}", file=sys.stderr)
        return codes.EXIT_UNREACHABLE
    except errors.AuthError as e:
        print(f"gcache admin: {e}", file=sys.stderr)
        return codes.EXIT_AUTH
    except grpc.RpcError as e:
        print(f"gcache admin: {e.code().name}: {e.details()}", file=sys.stderr)
        return codes.EXIT_MISS if e.code() == grpc.StatusCode.NOT_FOUND else codes.EXIT_ERROR
    finally:
        client.close()
