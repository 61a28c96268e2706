"""The Mooncake side of `--vs mooncake`, run by mooncake_peer inside `unshare -n`.

Starts mooncake_master and a storage-only client (which owns the segment), so
every byte the benchmark client moves crosses loopback TCP, warms the segment
once, and prints one line: READY_MARKER + JSON once it can run, else
RESULT_MARKER + {"available": false, "reason": ...}. Then it runs one workload
per line read from stdin ({"workload", "key_prefix"}: the same runs as the other
peers') and answers each with one line, RESULT_MARKER + {"ok": true, "figures":
...} or {"ok": false, "reason": ...}, so the bench can interleave Mooncake's runs
with the other stores'. It tears down when stdin closes.
Usage: python -m gcache.tools.storebench.peers.mooncake_side REQUEST_JSON
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from gcache.common.processes import stop_process, wait_listening

MASTER_PORT = 50051  # the namespace is private, so fixed ports are free
MASTER_METRICS_PORT = 9003
STORAGE_HOSTNAME = "127.0.0.1:17000"
START_TIMEOUT_S = 60.0
KV_LEASE_TTL_MS = 50  # short leases so untimed removes right after reads succeed
WARM_BATCH_BYTES = 16 << 20

STORAGE_CODE = r"""
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup(sys.argv[1], "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
sys.stdin.read()       # lives until the bench closes our stdin
store.close()
"""


def _warm_segment(store, segment_bytes: int) -> None:
    """Fills the whole segment once and empties it: first touch is slow in Mooncake."""
    chunk = 256 << 10
    per_batch = WARM_BATCH_BYTES // chunk
    buf = np.ones(WARM_BATCH_BYTES, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    ptrs = [buf.ctypes.data + i * chunk for i in range(per_batch)]
    keys_all = []
    for b in range(max(1, int(segment_bytes * 0.85) // WARM_BATCH_BYTES)):
        keys = [f"segment-warm/{b}/{i}" for i in range(per_batch)]
        store.batch_put_from(keys, ptrs, [chunk] * per_batch)
        keys_all.append(keys)
    time.sleep(KV_LEASE_TTL_MS / 1000 * 2)
    for keys in keys_all:
        store.batch_remove(keys)
    store.unregister_buffer(buf.ctypes.data)


def _answer(marker: str, payload: dict) -> None:
    sys.stdout.write(marker + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _serve(spec, cfg, request: dict, logdir: str) -> bool:
    """One workload per stdin line until stdin closes; False if any failed."""
    from gcache.tools.storebench import runner
    from gcache.tools.storebench.peers import mooncake_peer

    ok = True
    for line in sys.stdin:
        if not line.strip():
            continue
        ask = json.loads(line)
        try:
            figures = runner.run_workload(
                spec, ask["workload"], cfg, request["workers"], request["mode"], ask["key_prefix"]
            )
            _answer(mooncake_peer.RESULT_MARKER, {"ok": True, "figures": figures})
        except Exception as exc:  # reported to the parent, which drops Mooncake from later rounds
            ok = False
            reason = f"{type(exc).__name__}: {exc} (logs: {logdir})"
            _answer(mooncake_peer.RESULT_MARKER, {"ok": False, "reason": reason})
    return ok


def main() -> int:
    request = json.loads(sys.argv[1])
    import mooncake

    from gcache.tools.storebench.peers import mooncake_peer
    from gcache.tools.storebench.peers.base import PeerSpec
    from gcache.tools.storebench.workloads import WorkloadConfig

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    bindir = os.path.dirname(mooncake.__file__)
    logdir = tempfile.mkdtemp(prefix="gcache-bench-mooncake-")
    master = subprocess.Popen(
        [
            os.path.join(bindir, "mooncake_master"),
            f"--rpc_port={MASTER_PORT}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={MASTER_METRICS_PORT}",
            "--metrics_host=127.0.0.1",
            f"--default_kv_lease_ttl={KV_LEASE_TTL_MS}",
        ],
        stdout=open(os.path.join(logdir, "master.log"), "wb"),
        stderr=subprocess.STDOUT,
    )
    storage = None
    clean = False
    try:
        wait_listening(master, MASTER_PORT, START_TIMEOUT_S, "mooncake_master")
        master_address = f"127.0.0.1:{MASTER_PORT}"
        storage = subprocess.Popen(
            [sys.executable, "-c", STORAGE_CODE, STORAGE_HOSTNAME, str(request["segment_bytes"]), master_address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(logdir, "storage.log"), "wb"),
            text=True,
        )
        if storage.stdout is None:  # cannot happen: a pipe
            raise RuntimeError("invariant broken: a pipe")
        line = storage.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"Mooncake storage client did not start: {line or 'no output'} (logs: {logdir})")
        spec = PeerSpec("mooncake", master_address, {"local_buffer_bytes": request.get("local_buffer_bytes", 64 << 20)})
        store = mooncake_peer._shared_store(spec)
        _warm_segment(store, request["segment_bytes"])
        cfg = WorkloadConfig(**request["config"])
        _answer(mooncake_peer.READY_MARKER, {"segment_bytes": request["segment_bytes"]})
        clean = _serve(spec, cfg, request, logdir)
        mooncake_peer.close_shared_store()
    except Exception as exc:  # reported to the parent as a reason, the run goes on
        _answer(
            mooncake_peer.RESULT_MARKER, {"available": False, "reason": f"{type(exc).__name__}: {exc} (logs: {logdir})"}
        )
    finally:
        if storage is not None:
            if storage.stdin is None:  # cannot happen: a pipe
                raise RuntimeError("invariant broken: a pipe")
            storage.stdin.close()  # its cue to leave the store and exit
            try:
                storage.wait(30)
            except subprocess.TimeoutExpired:
                stop_process(storage, signal.SIGKILL)
        stop_process(master, timeout_s=30)
    if clean:  # the logs are kept only when something failed (the reason names them)
        shutil.rmtree(logdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
