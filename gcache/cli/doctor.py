"""`gcache doctor`: the host checks (gcache.common.host_checks) for a GCache host, no server
needed: one line per check, `ok`, `WARN` (with the fix) or `?` (unreadable: not an error).
gcache-server and gcache-worker log the same warnings at start."""

from __future__ import annotations

import json

from gcache.common.host_checks import CheckState, HostNeeds, run_checks
from gcache.common.units import parse_size

EXIT_WARN = 1
MARKS = {CheckState.OK: "ok  ", CheckState.WARN: "WARN", CheckState.UNKNOWN: "?   "}


def add_parser(sub) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check this host's settings for GCache (NUMA balancing, locked memory, huge pages, "
        "swap, open files, the memfd arena's limit); exit 1 on a warning",
    )
    doctor.add_argument("--memory", default="1GiB", help="the node's --memory, the arena (default: %(default)s)")
    doctor.add_argument(
        "--connections",
        type=int,
        default=1024 + 256,
        help="connections the node may hold: --connections-max, plus --preauth-connections-max "
        "with --auth-file (default: %(default)s)",
    )
    doctor.add_argument("--rdma", action="store_true", help="the node registers its arena for RDMA (--rdma-device)")
    doctor.add_argument("--root", default="/", help="read /proc and /sys under this directory (default: /)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    """Returns 0 when nothing warns, EXIT_WARN otherwise; raises ValueError on a bad --memory."""
    needs = HostNeeds(arena_bytes=parse_size(args.memory), rdma=args.rdma, connections=max(0, args.connections))
    results = run_checks(needs, args.root)
    if args.json:
        print(json.dumps({r.name: {"state": r.state.name.lower(), "detail": r.detail, "fix": r.fix} for r in results}))
    else:
        for r in results:
            line = f"{MARKS[r.state]} {r.name}: {r.detail}"
            print(line + (f"\n       fix: {r.fix}" if r.fix else ""))
    return EXIT_WARN if any(r.state == CheckState.WARN for r in results) else 0
