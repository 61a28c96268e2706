"""gcache-bench: GCache put/get/exists throughput and latency, beside its peers and the machine.

Examples:
  gcache-bench                                   # local gcache-server, all workloads
  gcache-bench --server 127.0.0.1:7600 --vs redis,mooncake --repeat 3 --json
  gcache-bench --workload put,get,latency --transport tcp,shm,rdma --vs mooncake
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import cast

from gcache.common.processes import exit_on_sigterm
from gcache.common.units import parse_duration, parse_size
from gcache.tools.storebench import limits as machine_limits
from gcache.tools.storebench import report as bench_report
from gcache.tools.storebench.peers.base import PeerSpec
from gcache.tools.storebench.progress import Progress
from gcache.tools.storebench.runner import System, combine_repeats, config_dict, local_system, run_rounds
from gcache.tools.storebench.workloads import WORKLOADS, WorkloadConfig

VALUE_SIZE_MIN, VALUE_SIZE_MAX = 4 << 10, 16 << 20
BATCH_MAX = 4096
BATCH_BUFFER_BYTES_MAX = 1 << 30  # one batch's values live in one numpy buffer
WORKERS_MAX = 64
DURATION_MAX_S = 3600.0
EXISTS_KEYS_MAX = 100_000
PEERS = ("redis", "mooncake")
TRANSPORTS = ("tcp", "shm", "rdma")
WARM_ESTIMATE_S = 1.5  # untimed set-up per workload run, for the progress bar
LIMITS_ESTIMATE_S = 2.5  # per round
MOONCAKE_START_ESTIMATE_S = 20.0
MOONCAKE_RUN_TIMEOUT_S = 120.0  # on top of 4x a run's planned time


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), got {text!r}")
        return items

    return parse


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gcache-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--server", metavar="HOST:PORT", help="a running gcache-server; default: start a local one for this run"
    )
    p.add_argument("--memory", default="1GiB", help="local server's memory tier (default 1GiB)")
    p.add_argument("--disk", default="2GiB", help="local server's disk tier (default 2GiB)")
    p.add_argument("--data-dir", help="local server's data folder (default: a temp folder, removed after)")
    p.add_argument(
        "--auth-file",
        metavar="FILE",
        help="start the local server with this --auth-file and authenticate as its first tenant "
        "with the read and write roles (default: no authentication)",
    )
    p.add_argument(
        "--token-file", metavar="FILE", help="token for --server (default: $GCACHE_TOKEN, $GCACHE_TOKEN_FILE)"
    )
    p.add_argument(
        "--workload",
        type=_csv(WORKLOADS),
        default=list(WORKLOADS),
        help="comma-separated subset of put,get,exists,latency (default: all)",
    )
    p.add_argument("--value-size", type=_size, default=256 << 10, help="bytes per value, 4KiB..16MiB (default 256KiB)")
    p.add_argument("--batch", type=int, default=64, help="keys per batched call (default 64)")
    workers = p.add_mutually_exclusive_group()
    workers.add_argument("--threads", type=int, help="client threads (default 1)")
    workers.add_argument("--processes", type=int, help="client processes instead of threads")
    p.add_argument("--duration", type=_duration, default=5.0, help="timed seconds per workload run (default 5s)")
    p.add_argument("--ops", type=int, help="stop each run after this many timed calls per worker")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds: each runs every workload once on every store in turn (gcache, redis, "
        "mooncake, gcache, ...); median, min and max are reported (default 3)",
    )
    p.add_argument(
        "--exists-keys", type=int, default=10_000, help="keys per batch_is_exist call, half present (default 10000)"
    )
    p.add_argument(
        "--working-set", type=_size, default=256 << 20, help="live bytes per worker in put and get (default 256MiB)"
    )
    p.add_argument(
        "--latency-value-size", type=_size, default=4 << 10, help="value size of the single-GET workload (default 4KiB)"
    )
    p.add_argument(
        "--transport",
        type=_csv(TRANSPORTS),
        help="run GCache once per client transport (comma-separated tcp,shm,rdma), each beside "
        "the machine's limits and its targets; an unavailable one is skipped with the reason "
        "(default: one run with the client's transport='auto')",
    )
    p.add_argument("--vs", type=_csv(PEERS), default=[], help="peers to run side by side: redis,mooncake")
    p.add_argument("--redis-url", help="use this Redis (redis://host:port) instead of starting redis-server")
    p.add_argument("--mooncake-segment", type=_size, help="Mooncake storage segment (default: fits the working sets)")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (fields: bench/README.md) instead of the table"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the results: each measure per transport beside the peers and the machine's "
        "limits, bars with the min..max spread (needs matplotlib: the bench extra)",
    )
    p.add_argument(
        "--from-json", metavar="FILE", help="draw --plot from a saved --json report instead of running the bench"
    )
    return p


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    def check(ok: bool, msg: str) -> None:
        if not ok:
            p.error(msg)

    check(VALUE_SIZE_MIN <= a.value_size <= VALUE_SIZE_MAX, "--value-size must be 4KiB..16MiB")
    check(1 <= a.batch <= BATCH_MAX, f"--batch must be 1..{BATCH_MAX}")
    check(
        a.batch * a.value_size <= BATCH_BUFFER_BYTES_MAX,
        "--batch x --value-size must stay within 1GiB: lower --batch for large values",
    )
    check(1 <= (a.threads or a.processes or 1) <= WORKERS_MAX, f"--threads/--processes must be 1..{WORKERS_MAX}")
    check(0 < a.duration <= DURATION_MAX_S, f"--duration must be in (0, {DURATION_MAX_S:g}s]")
    check(a.ops is None or a.ops >= 1, "--ops must be >= 1")
    check(1 <= a.repeat <= 20, "--repeat must be 1..20")
    check(2 <= a.exists_keys <= EXISTS_KEYS_MAX, f"--exists-keys must be 2..{EXISTS_KEYS_MAX}")
    check(a.working_set >= a.value_size, "--working-set must hold at least one value")
    check(1 <= a.latency_value_size <= VALUE_SIZE_MAX, "--latency-value-size must be 1B..16MiB")
    check(not (a.auth_file and a.server), "--auth-file starts a local server: with --server give --token-file")


def _say(args, msg: str) -> None:
    print(f"[gcache-bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    return args


def run(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns the report dict (what --json prints)."""
    return execute(parse_args(argv))


def _token(args) -> str | None:
    """The token the bench authenticates with: --auth-file's first read+write tenant, --token-file,
    or the environment (GCACHE_TOKEN / GCACHE_TOKEN_FILE)."""
    from gcache.wire.auth import AuthFileError, load_auth_file, read_token_file, resolve_token

    try:
        if args.auth_file:
            writers = [t for t in load_auth_file(args.auth_file).with_role("write") if t.has("read")]
            if not writers:
                raise SystemExit(f"gcache-bench: {args.auth_file} has no tenant with the read and write roles")
            return writers[0].token
        return read_token_file(args.token_file) if args.token_file else resolve_token()
    except (AuthFileError, ValueError) as exc:
        raise SystemExit(f"gcache-bench: {exc}") from None


def execute(args: argparse.Namespace) -> dict:
    """Starts the stores, runs the rounds (run_rounds: every round measures the machine, then
    each workload on every system back to back), stops the stores; returns the report."""
    workers = args.threads or args.processes or 1
    token = _token(args)
    mode = "processes" if args.processes else "threads"
    cfg = WorkloadConfig(
        value_size=args.value_size,
        batch=args.batch,
        duration_s=args.duration,
        ops_max=args.ops,
        exists_keys=args.exists_keys,
        working_set_bytes=args.working_set,
        latency_value_size=args.latency_value_size,
    )
    peers: dict[str, dict] = {}
    transports: dict[str, dict] | None = None
    mooncake_reason = None
    if "mooncake" in args.vs:
        from gcache.tools.storebench.peers import mooncake_peer

        mooncake_reason = mooncake_peer.unavailable_reason()
        if mooncake_reason:
            _say(args, f"--vs mooncake skipped: {mooncake_reason}")
            peers["mooncake"] = {"available": False, "reason": mooncake_reason}

    run_tag = f"bench-{uuid.uuid4().hex[:8]}"
    step_s = (args.duration if args.ops is None else 1.0) + WARM_ESTIMATE_S
    suites = len(args.transport or [None]) + len([v for v in args.vs if not (v == "mooncake" and mooncake_reason)])
    planned_s = (LIMITS_ESTIMATE_S + suites * len(args.workload) * step_s) * args.repeat
    server_info: dict = {"address": args.server, "local": args.server is None, "exit_code": None}
    local_server = None
    tmp_dir: str | None = None
    stoppers: list = []  # the peers' stores, stopped after the rounds (last started, first stopped)
    systems: list[System] = []
    try:
        with Progress(planned_s, enabled=not args.no_progress) as progress:
            if args.server is None:
                from gcache.tools.devcluster.local_server import LocalServer

                if args.data_dir is None:
                    tmp_dir = tempfile.mkdtemp(prefix="gcache-bench-")
                data_dir = Path(cast(str, args.data_dir or tmp_dir)) / "node"  # one of them is set
                extra = ["--auth-file", args.auth_file] if args.auth_file else []
                local_server = LocalServer(data_dir, memory=args.memory, disk=args.disk, extra_args=extra).start()
                server_info.update(
                    address=local_server.address, memory=args.memory, disk=args.disk, auth=bool(args.auth_file)
                )
            address = server_info["address"]
            options = {"token": token} if token else {}
            if args.transport:
                transports = _gcache_transports(args, address, options, cfg, workers, mode, systems)
            else:
                spec = PeerSpec("gcache", address, options)
                systems.append(local_system("gcache", spec, cfg, workers, mode, required=True))
                peers["gcache"] = {"available": True, "address": address}
            if "redis" in args.vs:
                peers["redis"] = _start_redis(args, cfg, workers, mode, systems, stoppers)
            if "mooncake" in args.vs and not mooncake_reason:
                progress.step("mooncake: start-up in a private netns", MOONCAKE_START_ESTIMATE_S)
                peers["mooncake"] = _start_mooncake(args, cfg, workers, mode, run_tag, step_s, systems, stoppers)

            batch_bytes = cfg.value_size * cfg.batch
            rounds = run_rounds(
                systems,
                args.workload,
                args.repeat,
                run_tag,
                lambda: machine_limits.measure_round(batch_bytes, cfg.latency_value_size),
                progress,
                step_s,
                LIMITS_ESTIMATE_S,
                lambda msg: _say(args, msg),
            )
            limits = machine_limits.combine_rounds(rounds.limits)
    finally:
        for stop in reversed(stoppers):
            stop()
        if local_server is not None:
            server_info["exit_code"] = local_server.stop()
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    for system in systems:
        if system.name in rounds.failed:
            entry = {"available": False, "reason": rounds.failed[system.name]}
        else:
            entry = {"workloads": {w: combine_repeats(runs) for w, runs in rounds.runs[system.name].items()}}
        if system.name.startswith("gcache/"):
            if transports is None:  # cannot happen: a gcache system ran
                raise RuntimeError("invariant broken: a gcache system ran")
            transports[system.name.split("/", 1)[1]].update(entry)
        else:
            peers[system.name].update(entry)
    if transports is not None:
        first = next((t for t in transports.values() if t["available"]), None)
        peers["gcache"] = first or {"available": False, "reason": "no transport could reach the server"}
    peers = {"gcache": peers["gcache"], **{n: p for n, p in peers.items() if n != "gcache"}}

    config = config_dict(cfg) | {
        "workloads": args.workload,
        "workers": workers,
        "mode": mode,
        "repeat": args.repeat,
        "vs": args.vs,
        "run_tag": run_tag,
        "systems": [s.name for s in systems],
    }
    config["transports"] = args.transport or []
    return bench_report.build(config, limits, peers, server_info, transports, rounds.order)


def _gcache_transports(args, address, options, cfg, workers, mode, systems) -> dict:
    """{transport: how it runs, or why it was skipped}, in the order asked; each available
    one joins the rounds as system "gcache/<transport>"."""
    from gcache.tools.storebench.peers.gcache_peer import transport_unavailable_reason

    out = {}
    for transport in args.transport:
        reason = transport_unavailable_reason(address, options.get("token"), transport)
        if reason:
            _say(args, f"--transport {transport} skipped: {reason}")
            out[transport] = {"available": False, "transport": transport, "reason": reason}
            continue
        spec = PeerSpec("gcache", address, options | {"transport": transport})
        systems.append(local_system(f"gcache/{transport}", spec, cfg, workers, mode, required=True))
        out[transport] = {"available": True, "transport": transport, "address": address}
    return out


def _start_redis(args, cfg, workers, mode, systems, stoppers) -> dict:
    from gcache.tools.devcluster.local_redis import LocalRedis
    from gcache.tools.storebench.peers.redis_peer import parse_redis_url

    try:
        if args.redis_url:
            address = parse_redis_url(args.redis_url)
            local = None
        else:
            local = LocalRedis()
            stoppers.append(local.stop)
            # Same host: its Unix socket, the fair baseline beside GCache's shared memory.
            address = local.local_address
    except Exception as exc:  # a missing peer must not sink the GCache figures
        _say(args, f"--vs redis failed: {exc}")
        return {"available": False, "reason": str(exc)}
    systems.append(local_system("redis", PeerSpec("redis", address), cfg, workers, mode))
    return {"available": True, "address": address, "local": local is not None}


def _start_mooncake(args, cfg, workers, mode, run_tag, step_s, systems, stoppers) -> dict:
    from gcache.tools.storebench.peers import mooncake_peer

    # room for warm-up plus working set per worker, well under Mooncake's 90% eviction watermark
    live = max(cfg.working_set_bytes, cfg.batch * cfg.value_size)
    segment = args.mooncake_segment or max(512 << 20, 4 * workers * live + (256 << 20))
    request = {"segment_bytes": segment, "config": config_dict(cfg), "workers": workers, "mode": mode}
    side = mooncake_peer.MooncakeSide(request)
    stoppers.append(side.close)
    try:
        side.start()
    except mooncake_peer.SideError as exc:
        _say(args, f"--vs mooncake failed: {exc}")
        return {"available": False, "reason": str(exc)}
    run_timeout_s = MOONCAKE_RUN_TIMEOUT_S + 4 * step_s
    systems.append(System("mooncake", lambda w, prefix: side.run(w, prefix, run_timeout_s)))
    return {"available": True, "segment_bytes": segment}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from-json needs --plot FILE.png")
        from gcache.tools.storebench.plot import plot_report

        with open(args.from_json) as f:
            plot_report(json.load(f), args.plot)
        return 0
    exit_on_sigterm()  # a stopped bench still stops its local server, Redis and Mooncake
    report = execute(args)
    if args.plot:
        from gcache.tools.storebench.plot import plot_report

        plot_report(report, args.plot)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(bench_report.render_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
