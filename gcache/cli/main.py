"""`gcache`: operator commands against one gcache-server, and `gcache admin` for the cluster."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gcache import errors

EXIT_OK = 0
EXIT_MISS = 1
EXIT_USAGE = 2
EXIT_NOT_ADMITTED = 3
EXIT_UNREACHABLE = 4
EXIT_ERROR = 5
EXIT_AUTH = 6

EPILOG = f"""\
exit codes:
  {EXIT_OK}  success
  {EXIT_MISS}  miss: `get` found no value, or `exists` found a key missing;
     `admin drain|remove`: no such node in the map
  {EXIT_USAGE}  bad arguments (including an invalid key or server address)
  {EXIT_NOT_ADMITTED}  `put` not admitted: the server has no space now; try later
  {EXIT_UNREACHABLE}  the server (for `admin`: every master) could not be reached or did not answer in time
  {EXIT_ERROR}  any other error (value too large, unreadable file, protocol or server error)
  {EXIT_AUTH}  the server refused the token (none, wrong, or without the role the command needs)

keys are UTF-8 text; pass --hex-keys to give them as hex bytes.
The server defaults to $GCACHE_SERVER, else 127.0.0.1:7600.
A node with --auth-file needs a token: --token-file FILE, else $GCACHE_TOKEN, else
the file named by $GCACHE_TOKEN_FILE (a token on the command line would show in `ps`).
`gcache admin --master URL map|status|drain NODE [--wait]|remove NODE` talks to the
gcache-master replicas (URL gcache://h:p,h:p; default $GCACHE_MASTER).
`gcache doctor [--memory SIZE] [--connections N] [--rdma]` checks this host's settings
(no server needed): exit 0 when nothing warns, 1 on a warning.
"""

# put reads the whole value into memory; this is an operator tool, not a loader.
CLI_VALUE_BYTES_MAX = 4 * 1024 * 1024 * 1024


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gcache",
        description="Operator commands for a GCache node.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--server",
        default=os.environ.get("GCACHE_SERVER", "127.0.0.1:7600"),
        help="host:port of the gcache-server (default: %(default)s)",
    )
    parser.add_argument("--timeout-s", type=float, default=5.0, help="socket timeout in seconds (default: %(default)s)")
    parser.add_argument("--hex-keys", action="store_true", help="keys are given as hex bytes")
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="file holding the tenant token (default: $GCACHE_TOKEN, $GCACHE_TOKEN_FILE)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    put = sub.add_parser("put", help="store FILE (or stdin for '-') under KEY")
    put.add_argument("key")
    put.add_argument("file", help="path, or '-' for stdin")

    get = sub.add_parser("get", help="write KEY's value to stdout or -o FILE (exit 1 on miss)")
    get.add_argument("key")
    get.add_argument("-o", "--output", help="write the value to this file instead of stdout")

    exists = sub.add_parser("exists", help="print 1/0 per key (exit 1 if any is missing)")
    exists.add_argument("keys", nargs="+", metavar="KEY")

    rm = sub.add_parser("rm", help="remove keys (removing a missing key is fine)")
    rm.add_argument("keys", nargs="+", metavar="KEY")

    stats = sub.add_parser("stats", help="print the server's counters, gauges and histograms")
    stats.add_argument("--json", action="store_true", help="print one JSON object")

    sub.add_parser("ping", help="check the server answers; print its version and round trip")

    from gcache.cli import admin as cli_admin
    from gcache.cli import doctor as cli_doctor

    cli_admin.add_parser(sub)
    cli_doctor.add_parser(sub)
    return parser


def _key(text: str, hex_keys: bool) -> bytes:
    if not hex_keys:
        return text.encode("utf-8")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise errors.KeyInvalidError(f"{text!r} is not hex (drop --hex-keys for text keys)") from None


def _read_value(path: str) -> bytes:
    if path == "-":
        data = sys.stdin.buffer.read(CLI_VALUE_BYTES_MAX + 1)
    else:
        with open(path, "rb") as f:
            data = f.read(CLI_VALUE_BYTES_MAX + 1)
    if len(data) > CLI_VALUE_BYTES_MAX:
        raise errors.InvalidArgumentError(f"the value exceeds the CLI's {CLI_VALUE_BYTES_MAX} B limit")
    return data


def _print_stats(stats: dict) -> None:
    for section in ("counters", "gauges"):
        values = stats.get(section) or {}
        if values:
            print(f"{section}:")
            width = max(len(name) for name in values)
            for name in sorted(values):
                print(f"  {name:<{width}}  {values[name]}")
    histograms = stats.get("histograms") or {}
    sums_us = stats.get("histogram_sums_us") or {}
    if histograms:
        print("histograms (count per bucket [2^i, 2^(i+1)) us, non-empty buckets):")
        for name in sorted(histograms):
            buckets = histograms[name]
            cells = ", ".join(f"2^{i}us:{n}" for i, n in enumerate(buckets) if n)
            total = sum(buckets)
            mean = f", mean {sums_us[name] / total:.1f} us" if total and name in sums_us else ""
            print(f"  {name}: total {total}{mean}; {cells or 'empty'}")


def _run(args, client) -> int:
    if args.command == "put":
        value = _read_value(args.file)
        if client.put(_key(args.key, args.hex_keys), value):
            print(f"stored {len(value)} bytes", file=sys.stderr)
            return EXIT_OK
        print("not admitted: the server has no space for this value now; try later", file=sys.stderr)
        return EXIT_NOT_ADMITTED
    if args.command == "get":
        value = client.get(_key(args.key, args.hex_keys))
        if value is None:
            print(f"miss: no value for key {args.key!r}", file=sys.stderr)
            return EXIT_MISS
        if args.output:
            with open(args.output, "wb") as f:
                f.write(value)
        else:
            sys.stdout.buffer.write(value)
            sys.stdout.buffer.flush()
        return EXIT_OK
    if args.command == "exists":
        found = client.batch_is_exist([_key(k, args.hex_keys) for k in args.keys])
        for key, ok in zip(args.keys, found):
            print(f"{int(ok)}\t{key}")
        return EXIT_OK if all(found) else EXIT_MISS
    if args.command == "rm":
        removed = client.batch_remove([_key(k, args.hex_keys) for k in args.keys])
        for key, ok in zip(args.keys, removed):
            print(f"{'removed' if ok else 'absent'}\t{key}")
        return EXIT_OK
    cluster = args.server.startswith("gcache://")  # answers come per node: {node id: answer}
    if args.command == "stats":
        stats = client.stats()
        if args.json:
            print(json.dumps(stats, sort_keys=True, default=str))
        elif cluster:
            for node_id, node_stats in sorted(stats.items()):
                print(f"== node {node_id}")
                if isinstance(node_stats, dict):
                    _print_stats(node_stats)
                else:
                    print(f"unreachable: {node_stats}")
        else:
            _print_stats(stats)
        return EXIT_OK
    if args.command == "ping":
        start = time.perf_counter()
        answer = client.ping()
        rtt_ms = (time.perf_counter() - start) * 1e3
        answers = answer.items() if cluster else [(args.server, answer)]
        down = 0
        for name, a in sorted(answers):
            if isinstance(a, dict):
                print(f"{name}: version {a.get('version')} epoch {a.get('epoch')}")
            else:
                down += 1
                print(f"{name}: unreachable: {a}")
        print(f"rtt {rtt_ms:.2f} ms")
        return EXIT_UNREACHABLE if down else EXIT_OK
    raise AssertionError(args.command)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "admin":
        from gcache.cli import admin as cli_admin

        return cli_admin.main(args, sys.modules[__name__])
    if args.command == "doctor":  # this host's settings: no server involved
        from gcache.cli import doctor as cli_doctor

        try:
            return cli_doctor.main(args)
        except ValueError as exc:
            print(f"gcache doctor: {exc}", file=sys.stderr)
            return EXIT_USAGE
    from gcache.client import Client  # after parsing, so --help stays fast
    from gcache.wire.auth import read_token_file, resolve_token

    try:
        token = read_token_file(args.token_file) if args.token_file else resolve_token()
    except ValueError as exc:
        print(f"gcache: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        # Client.__new__ returns the implementation for the address (gcache.client.factory);
        # mypy checks the abstract contract's constructor instead
        with Client(args.server, timeout_s=args.timeout_s, pool_size=1, token=token) as client:  # type: ignore[abstract, call-arg]
            return _run(args, client)
    except errors.AuthError as exc:
        print(f"gcache: {exc}", file=sys.stderr)
        return EXIT_AUTH
    except (errors.ConnectionError, errors.TimeoutError) as exc:
        print(f"gcache: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except errors.InvalidArgumentError as exc:
        print(f"gcache: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # stdout closed early, e.g. `gcache get K | head -c 10`
        return EXIT_OK
    except (errors.GCacheError, OSError) as exc:
        print(f"gcache: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
