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

from gcache.common.units import parse_duration, parse_size
from gcache.tools.storebench import limits as machine_limits
from gcache.tools.storebench import report as bench_report
from gcache.tools.storebench.peers.base import PeerSpec
from gcache.tools.storebench.progress import Progress
from gcache.tools.storebench.runner import config_dict, run_suite
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
LIMITS_ESTIMATE_S = 2.5  # per repeat


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
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are reported (default 3)")
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
    planned_s = LIMITS_ESTIMATE_S * args.repeat + suites * len(args.workload) * args.repeat * step_s
    server_info: dict = {"address": args.server, "local": args.server is None, "exit_code": None}
    local_server = tmp_dir = None
    try:
        with Progress(planned_s, enabled=not args.no_progress) as progress:
            if args.server is None:
                from gcache.tools.devcluster.local_server import LocalServer

                if args.data_dir is None:
                    tmp_dir = tempfile.mkdtemp(prefix="gcache-bench-")
                data_dir = Path(args.data_dir or tmp_dir) / "node"
                extra = ["--auth-file", args.auth_file] if args.auth_file else []
                local_server = LocalServer(data_dir, memory=args.memory, disk=args.disk, extra_args=extra).start()
                server_info.update(
                    address=local_server.address, memory=args.memory, disk=args.disk, auth=bool(args.auth_file)
                )
            progress.step("machine limits", LIMITS_ESTIMATE_S * args.repeat)
            limits = machine_limits.measure_limits(args.repeat, cfg.value_size * cfg.batch, cfg.latency_value_size)

            options = {"token": token} if token else {}
            if args.transport:
                transports = _run_transports(
                    args, server_info["address"], options, cfg, workers, mode, run_tag, progress, step_s
                )
                first = next((t for t in transports.values() if t["available"]), None)
                peers["gcache"] = first or {"available": False, "reason": "no transport could reach the server"}
            else:
                gcache_spec = PeerSpec("gcache", server_info["address"], options)
                peers["gcache"] = {
                    "available": True,
                    "address": gcache_spec.address,
                    "workloads": run_suite(
                        gcache_spec, args.workload, cfg, args.repeat, workers, mode, run_tag, progress, step_s
                    ),
                }
            if local_server is not None:
                server_info["exit_code"] = local_server.stop()
                local_server = None

            if "redis" in args.vs:
                peers["redis"] = _run_redis(args, cfg, workers, mode, run_tag, progress, step_s)
            if "mooncake" in args.vs and not mooncake_reason:
                peers["mooncake"] = _run_mooncake(args, cfg, workers, mode, run_tag, progress, step_s)
    finally:
        if local_server is not None:
            server_info["exit_code"] = local_server.stop()
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    config = config_dict(cfg) | {
        "workloads": args.workload,
        "workers": workers,
        "mode": mode,
        "repeat": args.repeat,
        "vs": args.vs,
        "run_tag": run_tag,
    }
    config["transports"] = args.transport or []
    return bench_report.build(config, limits, peers, server_info, transports)


def _run_transports(args, address, options, cfg, workers, mode, run_tag, progress, step_s) -> dict:
    """{transport: the gcache suite over it, or why it was skipped}, in the order asked."""
    from gcache.tools.storebench.peers.gcache_peer import transport_unavailable_reason

    out = {}
    for transport in args.transport:
        reason = transport_unavailable_reason(address, options.get("token"), transport)
        if reason:
            _say(args, f"--transport {transport} skipped: {reason}")
            out[transport] = {"available": False, "transport": transport, "reason": reason}
            continue
        spec = PeerSpec("gcache", address, options | {"transport": transport})
        out[transport] = {
            "available": True,
            "transport": transport,
            "address": address,
            "workloads": run_suite(
                spec, args.workload, cfg, args.repeat, workers, mode, f"{run_tag}/{transport}", progress, step_s
            ),
        }
    return out


def _run_redis(args, cfg, workers, mode, run_tag, progress, step_s) -> dict:
    from gcache.tools.devcluster.local_redis import LocalRedis
    from gcache.tools.storebench.peers.redis_peer import parse_redis_url

    local = None
    try:
        if args.redis_url:
            address = parse_redis_url(args.redis_url)
        else:
            local = LocalRedis()
            # Same host: its Unix socket, the fair baseline beside GCache's shared memory.
            address = local.local_address
        spec = PeerSpec("redis", address)
        return {
            "available": True,
            "address": address,
            "local": local is not None,
            "workloads": run_suite(spec, args.workload, cfg, args.repeat, workers, mode, run_tag, progress, step_s),
        }
    except Exception as exc:  # a missing peer must not sink the GCache figures
        _say(args, f"--vs redis failed: {exc}")
        return {"available": False, "reason": str(exc)}
    finally:
        if local is not None:
            local.stop()


def _run_mooncake(args, cfg, workers, mode, run_tag, progress, step_s) -> dict:
    from gcache.tools.storebench.peers import mooncake_peer

    # room for warm-up plus working set per worker, well under Mooncake's 90% eviction watermark
    live = max(cfg.working_set_bytes, cfg.batch * cfg.value_size)
    segment = args.mooncake_segment or max(512 << 20, 4 * workers * live + (256 << 20))
    plan_s = len(args.workload) * args.repeat * step_s
    progress.step(f"mooncake (in a private netns) x{len(args.workload) * args.repeat}", plan_s)
    request = {
        "segment_bytes": segment,
        "config": config_dict(cfg),
        "workloads": args.workload,
        "repeat": args.repeat,
        "workers": workers,
        "mode": mode,
        "run_tag": run_tag,
    }
    result = mooncake_peer.run_in_namespace(request, plan_s * 2 + mooncake_peer.SIDE_OVERHEAD_S)
    if not result.get("available"):
        _say(args, f"--vs mooncake failed: {result.get('reason')}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from-json needs --plot FILE.png")
        from gcache.tools.storebench.plot import plot_report

        with open(args.from_json) as f:
            plot_report(json.load(f), args.plot)
        return 0
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
