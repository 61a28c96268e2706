"""gcache-demo: the README's main job, on embedded defaults.

Starts a local gcache-server (1 GiB memory + 2 GiB disk under ./gcache-data),
runs a short gcache-bench against it (beside a local redis-server when one is
installed), prints what it measured, and stops the server with SIGTERM.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from gcache.bench import main as bench_main
from gcache.bench.local_server import LocalServer
from gcache.bench.report import render_table

DEMO_MEMORY = "1GiB"      # fits a 2-core, 24 GiB box with room for redis and the bench
DEMO_DISK = "2GiB"
DEMO_BENCH_ARGS = ["--duration", "1s", "--repeat", "3", "--working-set", "64MiB"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gcache-demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="gcache-data", help="server data folder (default ./gcache-data)")
    p.add_argument("--no-redis", action="store_true", help="skip the side-by-side Redis run")
    args = p.parse_args(argv)

    started = time.monotonic()
    server = LocalServer(Path(args.data_dir) / "node", memory=DEMO_MEMORY, disk=DEMO_DISK)
    print(f"[gcache-demo] starting gcache-server on {server.address} "
          f"(memory {DEMO_MEMORY}, disk {DEMO_DISK}, data {server.data_dir})", flush=True)
    server.start()
    try:
        bench_args = ["--server", server.address, *DEMO_BENCH_ARGS]
        if not args.no_redis and shutil.which("redis-server"):
            bench_args += ["--vs", "redis"]
        print(f"[gcache-demo] gcache-bench {' '.join(bench_args)}", flush=True)
        report = bench_main.run(bench_args)
    except BaseException:
        code = server.stop()
        print(f"[gcache-demo] bench failed; gcache-server stopped with exit code {code}", file=sys.stderr)
        print(server.log_tail(), file=sys.stderr)
        raise
    print(render_table(report), flush=True)
    code = server.stop()
    verdict = "clean stop" if code == 0 else "NOT a clean stop, see " + str(server.log_path)
    print(f"[gcache-demo] gcache-server stopped with SIGTERM: exit code {code} ({verdict}); "
          f"demo took {time.monotonic() - started:.0f}s", flush=True)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
