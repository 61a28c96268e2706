"""gcache-cluster: a local GCache cluster on loopback, for development, demos and tests.

  gcache-cluster up --masters 3 --nodes 3 --dir DIR   start it in the background
  gcache-cluster up --netns ... --dir DIR             each node in its own network namespace
                                                      (root; real partitions in `check`)
  gcache-cluster status --dir DIR                     processes and the cluster map
  gcache-cluster add-node --dir DIR                   start one more node (a join)
  gcache-cluster down --dir DIR                       stop everything `up` started
  gcache-cluster check --dir DIR --seed N             run the fault checker against it

DIR/cluster.json holds the client URL (use it as gcache.Client(url)) and, for
every process, its role, id, addresses, pid, data dir and log file; with
--netns also the bridge, subnet and each node's namespace (`down` removes them).
"""

from __future__ import annotations

import argparse
import json
import sys

from gcache.tools.devcluster.local_cluster import LocalCluster

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gcache-cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="start masters and nodes in the background")
    up.add_argument("--masters", type=int, default=3, help="master replicas, 1..5 (default 3)")
    up.add_argument("--nodes", type=int, default=3, help="gcache-server nodes (default 3)")
    up.add_argument("--memory", default="256MiB", help="memory tier per node (default 256MiB)")
    up.add_argument("--disk", default="512MiB", help="disk tier per node (default 512MiB)")
    up.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    up.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    up.add_argument("--migration-timeout-s", type=float, default=60.0)
    up.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for the cluster to be up")
    up.add_argument(
        "--auth",
        action="store_true",
        help="write DIR/secrets/auth.toml (tenants nodes, ops, app with random tokens) and run "
        "everything with it; clients use DIR/secrets/app.token (GCACHE_TOKEN_FILE)",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="make a throwaway CA in DIR/secrets (openssl) and serve the masters' gRPC over TLS; "
        "clients use DIR/secrets/ca.pem (GCACHE_MASTER_TLS_CA)",
    )
    up.add_argument(
        "--netns",
        action="store_true",
        help="run each node in its own network namespace behind a bridge, so a partition "
        "cuts its network for real (needs root and iproute2)",
    )
    for name, text in (
        ("status", "show the processes and the map"),
        ("add-node", "start one more node and wait until it is active"),
        ("down", "stop every process of the cluster"),
    ):
        sub.add_parser(name, help=text)
    check = sub.add_parser("check", help="run the seeded fault checker against the cluster")
    from gcache.tools.devcluster.checker import add_checker_arguments

    add_checker_arguments(check)
    for cmd in sub.choices.values():
        cmd.add_argument("--dir", required=True, help="folder holding cluster.json, data and logs")
    return p


def _status(cluster: LocalCluster) -> int:
    print(f"client url: {cluster.client_url}")
    if cluster.network is not None:
        net = cluster.network
        print(f"network: namespaces, bridge {net.bridge} {net.subnet} (masters on {net.gateway})")
    for m in cluster.members:
        state = "running" if m.alive() else "stopped"
        ports = " ".join(f"{k}={v}" for k, v in m.ports.items())
        where = f"  netns {m.netns}" if m.netns else ""
        print(f"  {m.role:6} {m.id:4} {m.host:12} {ports:40} pid {m.pid:<8} {state}  log {m.log}{where}")
    try:
        cmap = cluster.current_map()
    except Exception as e:  # noqa: BLE001 -- status must print what it can
        print(f"map: unavailable ({e})")
        return EXIT_FAILED
    print(f"map epoch {cmap.epoch}:")
    for n in cmap.nodes:
        print(f"  {n.id:6} {n.address:22} weight {n.weight:<5} {n.state}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            cluster = LocalCluster(
                args.dir,
                masters=args.masters,
                nodes=args.nodes,
                memory=args.memory,
                disk=args.disk,
                heartbeat_interval_s=args.heartbeat_interval_s,
                heartbeat_timeout_s=args.heartbeat_timeout_s,
                migration_timeout_s=args.migration_timeout_s,
                netns=args.netns,
                auth=args.auth,
                tls=args.tls,
            )
            cluster.up(args.timeout_s)
            out = {"client_url": cluster.client_url, "layout": str(cluster.dir / "cluster.json")}
            if args.auth:
                out["token_file"] = str(cluster.secrets_dir / "app.token")
            if args.tls:
                out["tls_ca"] = cluster.client_kwargs["tls_ca"]
            print(json.dumps(out))
            return EXIT_OK
        cluster = LocalCluster.load(args.dir)
        if args.command == "status":
            return _status(cluster)
        if args.command == "add-node":
            node = cluster.add_node()
            print(f"{node.id} active at {node.address}")
            return EXIT_OK
        if args.command == "down":
            cluster.down()
            net = f"; removed bridge {cluster.network.bridge} and node namespaces" if cluster.network else ""
            print(f"stopped {len(cluster.members)} processes{net}")
            return EXIT_OK
        if args.command == "check":
            from gcache.tools.devcluster.checker import run_checker_cli

            return run_checker_cli(cluster, args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"gcache-cluster: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, ValueError) else EXIT_FAILED
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
