"""Mooncake Store (MooncakeDistributedStore) as a bench peer, over TCP.

Mooncake's transfer engine listens on all interfaces, so the whole Mooncake
side (mooncake_master, a storage-only client holding the segment, and the
benchmark client driving it) runs in a private network namespace that has only
loopback: `unshare -n` starts mooncake_side.py, which stays up for the whole
bench and runs one workload per request, so its runs interleave with the other
stores'. This module holds the in-namespace Peer and MooncakeSide, the launcher
used outside.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from gcache.tools.storebench.peers.base import Peer, PeerSpec

RESULT_MARKER = "MOONCAKE_RESULT "
READY_MARKER = "MOONCAKE_READY "
IMPORT_CHECK_TIMEOUT_S = 60.0
START_TIMEOUT_S = 240.0  # master, storage client and segment warm-up
STOP_TIMEOUT_S = 60.0
WHEEL = "mooncake-transfer-engine-non-cuda"
LEASED_ERROR = -706  # batch_remove: the object still holds a read lease
LEASE_WAIT_S = 0.1  # > the master's --default_kv_lease_ttl set by mooncake_side
REMOVE_TRIES = 5

_store = None  # one store per process, shared by worker threads
_store_lock = threading.Lock()


def _shared_store(spec: PeerSpec):
    global _store
    with _store_lock:
        if _store is None:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            rc = store.setup(
                spec.options.get("local_hostname", "127.0.0.1"),
                "P2PHANDSHAKE",
                0,  # no segment: a pure client
                int(spec.options.get("local_buffer_bytes", 64 << 20)),
                "tcp",
                "",
                spec.address,
            )
            if rc != 0:
                raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
            _store = store
        return _store


def close_shared_store() -> None:
    global _store
    with _store_lock:
        if _store is not None:
            _store.close()
            _store = None


class MooncakePeer(Peer):
    name = "mooncake"

    def __init__(self, spec: PeerSpec):
        self.store = _shared_store(spec)
        self._registered: list[tuple[int, object]] = []  # (address, buffer kept alive)

    def prepare_buffer(self, buf):
        rc = self.store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer returned {rc}")
        self._registered.append((buf.ctypes.data, buf))

    @staticmethod
    def _slots(keys, buf, size):
        base = buf.ctypes.data
        return [base + i * size for i in range(len(keys))], [size] * len(keys)

    def put_from(self, keys, buf, size):
        ptrs, sizes = self._slots(keys, buf, size)
        return sum(1 for rc in self.store.batch_put_from(keys, ptrs, sizes) if rc == 0)

    def get_into(self, keys, buf, size):
        ptrs, sizes = self._slots(keys, buf, size)
        return sum(1 for n in self.store.batch_get_into(keys, ptrs, sizes) if n == size)

    def exists(self, keys):
        return sum(1 for rc in self.store.batch_is_exist(keys) if rc == 1)

    def get_one(self, key):
        value = self.store.get(key)
        return bytes(value) if value else None

    def remove(self, keys):
        """Untimed. A key read in the last lease period refuses removal, so wait it out."""
        for _ in range(REMOVE_TRIES):
            if not keys:
                return
            codes = self.store.batch_remove(keys)
            keys = [k for k, rc in zip(keys, codes) if rc == LEASED_ERROR]
            if keys:
                time.sleep(LEASE_WAIT_S)

    def close(self):
        for address, _buf in self._registered:
            self.store.unregister_buffer(address)
        self._registered.clear()


def open_peer(spec: PeerSpec) -> Peer:
    return MooncakePeer(spec)


def unavailable_reason() -> str | None:
    """None when --vs mooncake can run here, else a one-line reason."""
    if os.geteuid() != 0:
        return "needs root to run Mooncake in a private network namespace (unshare -n)"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux / iproute2)"
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mooncake.store, mooncake, os, sys; sys.stdout.write(os.path.dirname(mooncake.__file__))",
        ],
        capture_output=True,
        text=True,
        timeout=IMPORT_CHECK_TIMEOUT_S,
    )
    if check.returncode != 0:
        last = (check.stderr.strip().splitlines() or ["unknown error"])[-1]
        hint = " (apt-get install libibverbs1 libnuma1)" if "libibverbs" in last or "libnuma" in last else ""
        return f"`from mooncake.store import MooncakeDistributedStore` fails: {last}{hint}; pip install {WHEEL}"
    if not os.access(os.path.join(check.stdout, "mooncake_master"), os.X_OK):
        return f"mooncake_master is missing from the {WHEEL} wheel"
    return None


class SideError(RuntimeError):
    """The Mooncake side could not run (a one-line reason)."""


class MooncakeSide:
    """mooncake_side.py under `unshare -n`, up from start() to close(): run() has it run one
    workload and returns that run's figures; any failure raises SideError with a one-line
    reason (the side's log file is named in it and kept)."""

    def __init__(self, request: dict):
        self.request = request
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="gcache-bench-mooncake-", suffix=".log", delete=False)
        self._buffer = b""
        self._failed = False

    def start(self, timeout_s: float = START_TIMEOUT_S) -> MooncakeSide:
        cmd = ["unshare", "-n", "--", sys.executable, "-m", "gcache.tools.storebench.peers.mooncake_side"]
        self.proc = subprocess.Popen(
            [*cmd, json.dumps(self.request)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log
        )
        marker, answer = self._read_answer(timeout_s, "start")
        if marker != READY_MARKER:
            self._failed = True
            raise SideError(answer.get("reason") or f"the Mooncake side did not start (log: {self.log.name})")
        self.segment_bytes = answer.get("segment_bytes")
        return self

    def run(self, workload: str, key_prefix: str, timeout_s: float) -> dict:
        if self.proc is None or self.proc.stdin is None:  # cannot happen: started, with pipes
            raise RuntimeError("invariant broken: started, with pipes")
        try:
            self.proc.stdin.write((json.dumps({"workload": workload, "key_prefix": key_prefix}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            self._failed = True
            raise SideError(f"the Mooncake side is gone ({exc}; log: {self.log.name})") from None
        _marker, answer = self._read_answer(timeout_s, workload)
        if not answer.get("ok"):
            self._failed = True
            raise SideError(f"{answer.get('reason', 'no reason given')} (log: {self.log.name})")
        return answer["figures"]

    def _read_answer(self, timeout_s: float, what: str) -> tuple[str, dict]:
        """The next READY or RESULT line (other output is skipped), within timeout_s."""
        deadline = time.monotonic() + timeout_s
        if self.proc is None or self.proc.stdout is None:  # cannot happen: started, with pipes
            raise RuntimeError("invariant broken: started, with pipes")
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    for marker in (READY_MARKER, RESULT_MARKER):
                        if text.startswith(marker):
                            return marker, json.loads(text[len(marker) :])
                left = deadline - time.monotonic()
                if left <= 0:
                    self._failed = True
                    raise SideError(f"the Mooncake side ran past {timeout_s:.0f}s on {what} (log: {self.log.name})")
                if not sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    self._failed = True
                    code = self.proc.wait(STOP_TIMEOUT_S)
                    raise SideError(f"the Mooncake side exited with {code} on {what} (log: {self.log.name})")
                self._buffer += chunk

    def close(self) -> None:
        """Closes the side's stdin (its cue to tear down) and waits, bounded; the log is
        removed unless something failed."""
        if self.proc is not None:
            if self.proc.stdin is None or self.proc.stdout is None:  # cannot happen: started with pipes
                raise RuntimeError("invariant broken: started with pipes")
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._failed = True
            self.proc.stdout.close()
        self.log.close()
        if not self._failed:
            os.unlink(self.log.name)
