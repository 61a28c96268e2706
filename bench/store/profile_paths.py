"""Where a GCache data path spends its time (issue 31): one operation in a loop against a
real gcache-server process, with the client and the server profiled while it runs.

    .venv/bin/python -m bench.store.profile_paths --path tcp-get --profile stat,strace,perf --out /tmp/prof
    .venv/bin/python -m bench.store.profile_paths --path shm-get4k --profile none --runs 5
    .venv/bin/python -m bench.store.profile_paths --floors        # the machine's floors alone

Paths (the rows of gcache-bench's table; the same calls its workloads time):

    tcp-get    batch_get_into of `--batch` x `--value-size` (64 x 256 KiB) over TCP
    tcp-put    batch_put_from of the same over TCP (fresh keys every call)
    shm-get    the same GET through the mapped arena (LOOKUP, copy, RELEASE)
    shm-put    the same PUT through the arena (RESERVE, copy + hash, COMMIT)
    shm-get4k  single get() of a 4 KiB value through the shm transport (one LOOKUP,
               the value inline in its answer)
    tcp-get4k  the same over TCP (GET_BATCH of one key)

Timing: `--runs` loops of `--seconds` each (or `--ops` calls); every call is timed with
perf_counter and each run prints ops, GB/s and p50 / p99 of its calls; the summary is min /
median / max over the runs. A PUT run removes what it wrote in one large batch_remove every
`--live` bytes (untimed, but inside a profile window: it is one REMOVE frame per that many
bytes, counted apart below).

Profiles (`--profile`, comma-separated; each attaches to both processes for one timed run
of its own, so one profiler never slows another's run):

    stat    perf stat -e task-clock,context-switches,page-faults: CPU ms per call, per process
    strace  strace -f: every syscall of both processes (all their threads), counted per call
    perf    perf record -e cpu-clock -g: where the CPU goes, grouped into Python interpreter,
            native (gcache._native), libc copies, kernel copies (copy_user / memcpy in the
            kernel), the rest of the kernel, others; per process and in % of its samples

No hardware counters on this VM (cycles are "not supported"): perf samples the cpu-clock.
The machine is shared (load 5+ on 2 cores): CPU per call and syscalls per call are what
to compare, wall-clock rates swing by tens of percent.

`--baseline TREE` compares this checkout's client with another's (e.g. `git worktree add` of
the commit before, with its native module built or copied in) on one server started here: a
fresh worker process per tree every round, alternating bursts, so both see the same load.
It prints each tree's min / median / max of client CPU per call, p50 and GB/s, the ratio of
the medians, and the min / median / max over the rounds of each round's own ratio:

    .venv/bin/python -m bench.store.profile_paths --path shm-get4k --baseline ../before --runs 8 --seconds 0.3

`--floors` measures, in this process, what the hardware allows for the same bytes: one
thread's memcpy of a batch out of and into a rotating arena (gcache-bench's
memcpy_batch_gbps, memcpy_put_gbps), one TCP stream over loopback
through batch-sized buffers (loopback_tcp_batch_gbps), and a Python request / 4 KiB reply
ping-pong over TCP and over a Unix socket (p50): a client that needs one round trip
cannot beat the ping-pong of its own transport.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gcache.common.units import parse_size

PATHS = ("tcp-get", "tcp-put", "shm-get", "shm-put", "shm-get4k", "tcp-get4k")
PROFILERS = ("stat", "strace", "perf")
GET_WORKING_SET_BYTES = 256 << 20  # gcache-bench's get working set
PUT_LIVE_BYTES_DEFAULT = 512 << 20  # --live
FLOOR_PROFILE_BATCHES = 256  # batches a profiled loopback moves (4 GiB of 16 MiB batches)
SMALL_KEYS = 256  # keys the single-GET paths cycle over (gcache-bench's latency_keys)
ATTACH_WAIT_S = 1.5  # a profiler attaching to every thread of a process
PERF_FREQ_HZ = 4000


@dataclass
class Path_:
    name: str
    transport: str
    op: str  # get, put, one


def path_of(name: str) -> Path_:
    transport, op = name.split("-", 1)
    return Path_(name, transport, {"get": "get", "put": "put", "get4k": "one"}[op])


# -- the loops ---------------------------------------------------------------------------


class Loop:
    """One client and its prepared keys; `run()` is one timed loop."""

    def __init__(
        self,
        address: str,
        path: Path_,
        batch: int,
        size: int,
        small_size: int,
        live_bytes: int,
        working_set_bytes: int = GET_WORKING_SET_BYTES,
    ):
        import gcache

        self.client = gcache.Client(address, timeout_s=60.0, transport=path.transport)
        if self.client.transport != path.transport:
            raise SystemExit(f"the client picked {self.client.transport!r}, not {path.transport!r}")
        self.path, self.batch, self.size = path, batch, size
        self.sizes = [size] * batch
        self.offsets = [i * size for i in range(batch)]
        rng = np.random.default_rng(1)
        self.removes = 0
        self._seq = 0
        self._live: list[str] = []
        self.live_bytes = live_bytes
        if path.op == "one":
            self.small_size = small_size
            src = rng.integers(0, 256, SMALL_KEYS * small_size, dtype=np.uint8)
            self.keys = [f"prof/small/{i}" for i in range(SMALL_KEYS)]
            self.values = [src[i * small_size : (i + 1) * small_size].tobytes() for i in range(SMALL_KEYS)]
            assert all(self.client.put_batch(self.keys, self.values))
            for key, value in zip(self.keys, self.values):
                assert self.client.get(key) == value
        else:
            self.buf = rng.integers(0, 256, batch * size, dtype=np.uint8)
            self.out = np.zeros_like(self.buf)
            if path.op == "get":
                # gcache-bench's get: a working set (256 MiB) read round robin.
                batches = max(1, working_set_bytes // (batch * size))
                self.groups = [[f"prof/get/{g}/{i}" for i in range(batch)] for g in range(batches)]
                for keys in self.groups:
                    assert all(self.client.batch_put_from(keys, self.buf, self.sizes, self.offsets))
                for keys in self.groups:
                    self.out.fill(0)
                    assert self.client.batch_get_into(keys, self.out, self.sizes, self.offsets) == self.sizes
                    assert np.array_equal(self.out, self.buf)
            else:
                # Warm: every arena page the timed puts may land on is touched once.
                for _ in range(max(2, 2 * live_bytes // (batch * size))):
                    self._put_once()
                self._drop_live()

    def _put_once(self) -> None:
        keys = [f"prof/put/{self._seq}/{i}" for i in range(self.batch)]
        self._seq += 1
        assert all(self.client.batch_put_from(keys, self.buf, self.sizes, self.offsets))
        self._live += keys

    def _drop_live(self) -> None:
        if self._live:
            self.client.batch_remove(self._live)
            self.removes += 1
            self._live = []

    def run(self, seconds: float, ops_max: int | None, server_pid: int | None = None) -> dict:
        """One timed loop. CPU per call: this process's (every thread: the shm copy pool
        too) and, with server_pid, the server process's (/proc, every thread)."""
        lat: list[float] = []
        mine0, server0 = resource.getrusage(resource.RUSAGE_SELF), process_cpu_s(server_pid)
        clock = time.perf_counter
        end = clock() + seconds
        i = 0
        self.removes = 0
        op = self.path.op
        while (ops_max is None and clock() < end) or (ops_max is not None and i < ops_max):
            if op == "get":
                keys = self.groups[i % len(self.groups)]
                start = clock()
                got = self.client.batch_get_into(keys, self.out, self.sizes, self.offsets)
                lat.append(clock() - start)
                if got != self.sizes:
                    raise SystemExit(f"GET returned {got[:4]}...")
            elif op == "put":
                keys = [f"prof/put/{self._seq}/{j}" for j in range(self.batch)]
                self._seq += 1
                start = clock()
                stored = self.client.batch_put_from(keys, self.buf, self.sizes, self.offsets)
                lat.append(clock() - start)
                if not all(stored):
                    raise SystemExit("PUT refused a value")
                self._live += keys
                if len(self._live) * self.size >= self.live_bytes:
                    self._drop_live()
            else:
                j = i % SMALL_KEYS
                start = clock()
                value = self.client.get(self.keys[j])
                lat.append(clock() - start)
                if value != self.values[j]:
                    raise SystemExit(f"get({self.keys[j]!r}) returned other bytes")
            i += 1
        mine = resource.getrusage(resource.RUSAGE_SELF)  # every thread, microseconds
        user, system = mine.ru_utime - mine0.ru_utime, mine.ru_stime - mine0.ru_stime
        server_user, server_system = (a - b for a, b in zip(process_cpu_s(server_pid), server0))
        if op == "get" and not np.array_equal(self.out, self.buf):
            raise SystemExit("GET bytes differ")
        per_op_bytes = self.small_size if op == "one" else self.batch * self.size
        total = sum(lat)
        us = np.array(lat) * 1e6
        return {
            "ops": len(lat),
            "seconds": total,
            "gbps": len(lat) * per_op_bytes / total / 1e9,
            "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()),
            "removes": self.removes,
            "client_cpu_us_per_op": (user + system) * 1e6 / len(lat),
            "client_user_us_per_op": user * 1e6 / len(lat),  # Python and native code
            "client_system_us_per_op": system * 1e6 / len(lat),  # the kernel: syscalls, copies, TCP
            "server_cpu_us_per_op": (server_user + server_system) * 1e6 / len(lat) if server_pid else None,
            "server_user_us_per_op": server_user * 1e6 / len(lat) if server_pid else None,
            "server_system_us_per_op": server_system * 1e6 / len(lat) if server_pid else None,
        }

    def close(self) -> None:
        self.client.close()


def process_cpu_s(pid: int | None) -> tuple[float, float]:
    """(user, system) CPU seconds of every thread of `pid` so far ((0, 0) without one)."""
    if not pid:
        return 0.0, 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


# -- profilers attached to both processes -------------------------------------------------


def _tids(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _traced(pid: int) -> bool:
    for tid in _tids(pid):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        if re.search(r"^TracerPid:\s+0$", status, re.M):
            return False
    return True


class Attached:
    """A profiler process attached to `pid` for the length of a `with` block."""

    def __init__(self, kind: str, pid: int, out: Path, role: str):
        self.kind, self.pid, self.role = kind, pid, role
        self.file = out / f"{role}.{kind}"
        if kind == "stat":
            cmd = ["perf", "stat", "-x", ",", "-e", "task-clock,context-switches,cpu-migrations,page-faults"]
            cmd += ["-p", str(pid), "-o", str(self.file)]
        elif kind == "strace":
            cmd = ["strace", "-f", "-qq", "-o", str(self.file), "-p", str(pid)]
        else:
            cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(PERF_FREQ_HZ), "-g", "-p", str(pid)]
            cmd += ["-o", str(self.file)]
        self.cmd = cmd

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        time.sleep(ATTACH_WAIT_S)
        while self.kind == "strace" and not _traced(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if self.proc.returncode not in (0, -signal.SIGINT, 130) and err:
            print(f"  ({self.role} {self.kind}: {err.decode(errors='replace').strip()[-300:]})", file=sys.stderr)


def parse_stat(file: Path) -> dict:
    out = {}
    for line in file.read_text().splitlines():
        parts = line.split(",")
        if len(parts) > 3 and parts[0] and parts[0][0].isdigit():
            out[parts[2]] = float(parts[0])
    return out


_STRACE_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")


def parse_strace(file: Path) -> dict[int, collections.Counter]:
    """{tid: Counter(syscall: calls)}; a call split by another thread's line counts once."""
    per_tid: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in file.read_text(errors="replace").splitlines():
        m = _STRACE_LINE.match(line)
        if m and m.group(3):
            per_tid[int(m.group(1))][m.group(3)] += 1
    return per_tid


KERNEL_COPY = re.compile(r"copy_user|copy_to_iter|copy_from_iter|_copy_to_user|_copy_from_user|rep_movs|memcpy|memmove")
USER_COPY = re.compile(r"memcpy|memmove|copy_streaming|copy_bytes|__memmove")
HASH = re.compile(r"XXH|xxh|checksum", re.I)
FUSED = re.compile(r"fused_avx")  # common/xxh3_copy.cpp: the copy and its XXH3 in one pass


def categorize(dso: str, sym: str) -> str:
    if dso.startswith("[kernel"):
        return "kernel copy" if KERNEL_COPY.search(sym) else "kernel other"
    if "_native" in dso:
        if FUSED.search(sym):
            return "native copy+hash (fused)"
        if HASH.search(sym):
            return "native hash"
        return "native copy" if USER_COPY.search(sym) else "native other"
    if "xxhash" in dso:
        return "native hash"
    if "libc" in dso:
        return "libc copy" if USER_COPY.search(sym) else "libc other"
    if "multiarray" in dso or "numpy" in dso:
        return "numpy"
    if "msgpack" in dso:
        return "msgpack"
    if dso.startswith("libpython") or dso.startswith("python"):
        return "python interpreter"
    return "other"


def parse_perf(file: Path) -> tuple[collections.Counter, list[tuple[float, str, str]]]:
    """(samples per category, [(percent, dso, symbol)] of the top leaves)."""
    report = subprocess.run(
        ["perf", "report", "-i", str(file), "--no-children", "--sort", "dso,sym", "-g", "none", "--stdio", "-n"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    cats: collections.Counter = collections.Counter()
    top = []
    for line in report.splitlines():
        m = re.match(r"^\s+([\d.]+)%\s+(\d+)\s+(\S+)\s+\[(.)\]\s+(.*)$", line)
        if not m:
            continue
        pct, samples, dso, _, sym = float(m.group(1)), int(m.group(2)), m.group(3), m.group(4), m.group(5).strip()
        cats[categorize(dso, sym)] += samples
        top.append((pct, dso, sym))
    return cats, top[:25]


def summarize_profile(kind: str, out: Path, roles: tuple[str, ...], n: int) -> dict:
    """Per role, what its profiler file says per operation (n operations)."""
    report: dict = {}
    for role in roles:
        file = out / f"{role}.{kind}"
        if kind == "stat":
            stat = parse_stat(file)
            report[role] = {
                "cpu_us_per_op": stat.get("task-clock", 0) * 1e3 / n,
                "context_switches_per_op": stat.get("context-switches", 0) / n,
                "page_faults_per_op": stat.get("page-faults", 0) / n,
            }
        elif kind == "strace":
            per_tid = parse_strace(file)
            total: collections.Counter = collections.Counter()
            for c in per_tid.values():
                total.update(c)
            busy = {tid: sum(c.values()) for tid, c in per_tid.items()}
            report[role] = {
                "syscalls_per_op": sum(total.values()) / n,
                "by_call_per_op": {k: round(v / n, 3) for k, v in total.most_common()},
                "threads": {tid: busy[tid] for tid in sorted(busy, key=busy.get, reverse=True)},
            }
        else:
            cats, top = parse_perf(file)
            samples = sum(cats.values())
            report[role] = {
                "cpu_us_per_op": samples / PERF_FREQ_HZ * 1e6 / n,
                "share": {k: round(100 * v / max(samples, 1), 1) for k, v in cats.most_common()},
                "top": [f"{pct:5.1f}% {dso} {sym}" for pct, dso, sym in top[:15]],
            }
    return report


def profile_run(kind: str, loop: Loop, server_pid: int, out: Path, seconds: float, ops: int | None) -> dict:
    with Attached(kind, server_pid, out, "server"), Attached(kind, os.getpid(), out, "client"):
        figures = loop.run(seconds, ops, server_pid)
    n = figures["ops"]
    report: dict = {"ops": n, "removes": figures["removes"], "gbps": figures["gbps"], "p50_us": figures["p50_us"]}
    report.update(summarize_profile(kind, out, ("client", "server"), n))
    return report


def profile_floor(kind: str, out: Path, batch_bytes: int, batches: int, **footprint) -> dict:
    """The loopback floor with `kind` attached to its sender and receiver (per batch)."""

    @contextlib.contextmanager
    def attach(sender_pid: int, receiver_pid: int):
        with Attached(kind, sender_pid, out, "sender"), Attached(kind, receiver_pid, out, "receiver"):
            yield

    figures = loopback(batch_bytes, batches, attach=attach, **footprint)
    return {"figures": figures, **summarize_profile(kind, out, ("sender", "receiver"), batches)}


# -- the machine's floors -----------------------------------------------------------------
# Each floor reports its rate or latency and the CPU each side spent per operation (the
# child's from wait4's rusage, this process's from thread_time), so a loaded machine that
# stretches wall clocks leaves the CPU figures comparable with the paths' perf stat.

PONG = r"""
import os, socket, sys, time
family, where, request_bytes, reply_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if family == "unix":
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(where)
else:
    conn = socket.create_connection(("127.0.0.1", int(where)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
reply = b"\x02" * reply_bytes
buf = memoryview(bytearray(request_bytes))
cpu0, rounds = None, 0
while True:
    got = 0
    while got < request_bytes:
        n = conn.recv_into(buf[got:])
        if n == 0:
            print(rounds, time.thread_time() - cpu0)  # the loop's CPU, from the first request
            sys.exit(0)
        got += n
    if cpu0 is None:
        cpu0 = time.thread_time()
    rounds += 1
    conn.sendall(reply)
"""

SENDER = r"""
import socket, sys, time
port, total, chunk, buffer_bytes = map(int, sys.argv[1:5])
payload = memoryview(bytearray(b"\x01" * buffer_bytes))
with socket.create_connection(("127.0.0.1", port)) as out:
    print("connected", flush=True)
    sys.stdin.readline()  # go: the profilers (if any) are attached
    cpu0 = time.thread_time()
    sent = 0
    while sent < total:
        at = sent % buffer_bytes
        n = min(chunk, total - sent, buffer_bytes - at)
        out.sendall(payload[at:at + n])
        sent += n
    print(time.thread_time() - cpu0)
"""

RECEIVER = r"""
import socket, sys, time
total, chunk, buffer_bytes = map(int, sys.argv[1:4])
sink = memoryview(bytearray(buffer_bytes))
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
received = 0
n = conn.recv_into(sink, 1)  # the clock starts at the first byte
received, cpu0, start = n, time.thread_time(), time.perf_counter()
while received < total and n:
    at = received % buffer_bytes
    n = conn.recv_into(sink[at:], min(chunk, buffer_bytes - at, total - received))
    received += n
print(received, time.perf_counter() - start, time.thread_time() - cpu0)
"""


def _listener(family: str, tmp: str) -> tuple[socket.socket, str]:
    if family == "unix":
        path = os.path.join(tmp, "floor.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(1)
        return s, path
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, str(s.getsockname()[1])


def _child_report(proc: subprocess.Popen) -> list[float]:
    """The numbers the child printed last (its loop's CPU), once it exited."""
    out, _ = proc.communicate(timeout=60)
    return [float(x) for x in out.split()]


def pingpong(family: str, reply_bytes: int = 4096, rounds: int = 4000) -> dict:
    """A Python request (32 B) / reply (`reply_bytes`) over loopback TCP or a Unix socket:
    the least one round trip of a Python client costs. p50 and CPU per round trip each side
    (the pong process's CPU includes its start, a few ms over `rounds`)."""
    with tempfile.TemporaryDirectory() as tmp:
        listener, where = _listener(family, tmp)
        ponger = subprocess.Popen(
            [sys.executable, "-c", PONG, family, where, "32", str(reply_bytes)], stdout=subprocess.PIPE, text=True
        )
        samples = []
        try:
            conn, _ = listener.accept()
            if family == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request, reply = b"\x01" * 32, memoryview(bytearray(reply_bytes))
            with conn:
                for i in range(rounds + rounds // 10):
                    if i == rounds // 10:
                        cpu0 = time.thread_time()
                    start = time.perf_counter()
                    conn.sendall(request)
                    got = 0
                    while got < reply_bytes:
                        got += conn.recv_into(reply[got:])
                    if i >= rounds // 10:
                        samples.append(time.perf_counter() - start)
                cpu = time.thread_time() - cpu0
        finally:
            listener.close()
        pong_rounds, pong_cpu_s = _child_report(ponger)
    return {
        "p50_us": statistics.median(samples) * 1e6,
        "client_cpu_us_per_op": cpu * 1e6 / rounds,
        "server_cpu_us_per_op": pong_cpu_s * 1e6 / pong_rounds,
    }


def loopback(
    batch_bytes: int,
    batches: int = 32,
    sender_bytes: int | None = None,
    receiver_bytes: int | None = None,
    chunk_bytes: int = 4 << 20,
    attach=None,
) -> dict:
    """One TCP stream over 127.0.0.1 between two processes, each streaming through a buffer
    of one batch's bytes (gcache-bench's loopback_tcp_batch_gbps) or of `sender_bytes` /
    `receiver_bytes` (a store's working set: memory, not cache): GB/s and the CPU each side
    spends per batch (both copies and the TCP stack; no Python in the loop but one sendall /
    recv_into per 4 MiB). `attach(sender_pid, receiver_pid)`, a context manager, wraps the
    transfer (profilers)."""
    total = batch_bytes * batches
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(total), str(chunk_bytes), str(receiver_bytes or batch_bytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    port = receiver.stdout.readline().strip()
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, port, str(total), str(chunk_bytes), str(sender_bytes or batch_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if sender.stdout.readline().strip() != "connected":  # its buffer is built: attach now
        raise RuntimeError("the loopback sender did not connect")
    with attach(sender.pid, receiver.pid) if attach else contextlib.nullcontext():
        sender.stdin.write("go\n")
        sender.stdin.flush()
        received, elapsed, receiver_cpu_s = _child_report(receiver)
        (sender_cpu_s,) = _child_report(sender)
    if received != total:
        raise RuntimeError(f"loopback moved {received} of {total} bytes")
    return {
        "gbps": received / elapsed / 1e9,
        "receiver_cpu_us_per_batch": receiver_cpu_s * 1e6 / batches,
        "sender_cpu_us_per_batch": sender_cpu_s * 1e6 / batches,
    }


def memcpy_batch(batch_bytes: int, seconds: float = 0.5) -> dict:
    """One thread copying one batch into one buffer from a rotating 256 MiB source
    (gcache-bench's memcpy_batch_gbps): GB/s and CPU per batch."""
    from gcache.tools.storebench import limits

    gbps = limits.memcpy_batch_gbps(batch_bytes, seconds=seconds)
    return {"gbps": gbps, "us_per_batch": batch_bytes / (gbps * 1e9) * 1e6}


def memcpy_put(batch_bytes: int, seconds: float = 0.5) -> dict:
    """One thread copying one batch-sized buffer into a rotating 256 MiB destination
    (gcache-bench's memcpy_put_gbps, what shm-put's copy into arena blocks must do)."""
    from gcache.tools.storebench import limits

    gbps = limits.memcpy_put_gbps(batch_bytes, seconds=seconds)
    return {"gbps": gbps, "us_per_batch": batch_bytes / (gbps * 1e9) * 1e6}


# -- main ---------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    v = sorted(values)
    return f"{v[0]:.3g} / {statistics.median(v):.3g} / {v[-1]:.3g}"


def start_server(memory: str, tmp: Path):
    from gcache.tools.devcluster.local_server import LocalServer

    return LocalServer(tmp / "data", memory=memory, disk="0").start()


RUN_FIELDS = (
    "gbps",
    "p50_us",
    "p99_us",
    "client_cpu_us_per_op",
    "client_user_us_per_op",
    "client_system_us_per_op",
    "server_cpu_us_per_op",
    "server_user_us_per_op",
    "server_system_us_per_op",
)


def floor_round(batch_bytes: int) -> dict:
    return {
        "memcpy_batch": memcpy_batch(batch_bytes),
        "memcpy_put": memcpy_put(batch_bytes),
        "loopback_tcp_batch": loopback(batch_bytes),
        # The sender streams through a GET's working set (the store reads its arena from
        # memory), the receiver through one batch (the caller's buffer), as in tcp-get.
        "loopback_tcp_get_footprint": loopback(batch_bytes, sender_bytes=GET_WORKING_SET_BYTES),
        # The receiver streams through a PUT's live bytes (arena blocks), as in tcp-put.
        "loopback_tcp_put_footprint": loopback(batch_bytes, receiver_bytes=PUT_LIVE_BYTES_DEFAULT),
        "pingpong_tcp_4k": pingpong("tcp"),
        "pingpong_unix_4k": pingpong("unix"),
    }


def print_summary(report: dict) -> None:
    """min / median / max over the rounds of every figure."""
    for name, entry in report["paths"].items():
        runs = entry["runs"]
        for field in RUN_FIELDS:
            values = [r[field] for r in runs if r.get(field) is not None]
            if values:
                print(f"{name:10s} {field:22s} min/median/max {spread(values)}")
    rounds = report.get("floors") or []
    for probe in rounds[0] if rounds else []:
        for field in rounds[0][probe]:
            print(f"floor {probe:20s} {field:26s} min/median/max {spread([r[probe][field] for r in rounds])}")


# -- A/B against another checkout's client --------------------------------------------------

AB_BURSTS = 4  # per worker and round; the first warms up and is dropped


def worker_main(argv: list[str]) -> int:
    """`--worker ADDRESS PATH BATCH SIZE SMALL LIVE`: one path's Loop in this process (whose
    gcache is the tree first on PYTHONPATH); each stdin line "SECONDS OPS" runs one timed
    loop and prints its figures as one JSON line."""
    address, name, batch, size, small, live, working_set = argv
    loop = Loop(address, path_of(name), int(batch), int(size), int(small), int(live), int(working_set))
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            seconds, ops = line.split()
            print(json.dumps(loop.run(float(seconds), None if ops == "-" else int(ops))), flush=True)
    finally:
        loop.close()
    return 0


def ab_compare(args, address: str, name: str) -> dict:
    """This tree's client against `args.baseline`'s, both on the same server: every round
    starts a fresh worker process per tree (no process keeps a lucky CPU placement), and
    they alternate bursts of `--seconds` (or `--ops` calls), the order flipped every time."""
    trees = {"this": str(Path(__file__).resolve().parents[2]), "baseline": str(Path(args.baseline).resolve())}
    runs: dict[str, list[dict]] = {side: [] for side in trees}
    burst = f"{args.seconds} {args.ops if args.ops else '-'}\n"
    worker_argv = [name, str(args.batch), str(args.value_size), str(args.small_size), str(args.live)]
    worker_argv.append(str(args.working_set))
    for rnd in range(args.runs):
        order = list(trees) if rnd % 2 == 0 else list(reversed(list(trees)))
        procs = {}
        try:
            for side in order:
                procs[side] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", address, *worker_argv],
                    cwd=trees[side],
                    env=dict(os.environ, PYTHONPATH=trees[side]),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                if procs[side].stdout.readline().strip() != "ready":
                    raise SystemExit(f"the {side} worker ({trees[side]}) did not start")
            for b in range(AB_BURSTS):
                for side in order if b % 2 == 0 else list(reversed(order)):
                    procs[side].stdin.write(burst)
                    procs[side].stdin.flush()
                    figures = json.loads(procs[side].stdout.readline())
                    if b:
                        runs[side].append(dict(figures, round=rnd))
        finally:
            for proc in procs.values():
                proc.stdin.close()
                proc.wait(60)
    result: dict = {"trees": trees, "runs": runs}
    for field in ("client_cpu_us_per_op", "p50_us", "gbps"):
        med = {side: statistics.median(r[field] for r in runs[side]) for side in trees}
        result[field] = {side: spread([r[field] for r in runs[side]]) for side in trees}
        result[field]["this / baseline (medians)"] = f"{med['this'] / med['baseline']:.3f}"
        ratios = round_ratios(runs, field)
        result[field]["this / baseline per round"] = spread(ratios)
        print(
            f"A/B {name:10s} {field:22s} this {result[field]['this']}   baseline {result[field]['baseline']}   "
            f"this / baseline {result[field]['this / baseline (medians)']}   "
            f"per round ({len(ratios)}) min/median/max {spread(ratios)}",
            flush=True,
        )
    return result


def round_ratios(runs: dict[str, list[dict]], field: str) -> list[float]:
    """this / baseline of `field` in each round (the median of each side's bursts in it): the
    two sides of a round ran under the same load, so its ratio is what the load leaves alone."""
    per_round: dict[int, dict[str, list[float]]] = collections.defaultdict(lambda: {"this": [], "baseline": []})
    for side, side_runs in runs.items():
        for r in side_runs:
            per_round[r["round"]][side].append(r[field])
    return [
        statistics.median(sides["this"]) / statistics.median(sides["baseline"])
        for _, sides in sorted(per_round.items())
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", choices=PATHS, action="append", help="the path(s) to run (default: the four rows)")
    p.add_argument("--profile", default="none", help="comma-separated: stat,strace,perf (default none)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--value-size", type=parse_size, default=256 << 10)
    p.add_argument("--small-size", type=parse_size, default=4 << 10, help="value size of the *-get4k paths")
    p.add_argument("--seconds", type=float, default=3.0, help="per timed run")
    p.add_argument("--ops", type=int, help="calls per timed run instead of --seconds")
    p.add_argument("--runs", type=int, default=3, help="rounds: each runs every path once (and the floors)")
    p.add_argument("--live", type=parse_size, default=PUT_LIVE_BYTES_DEFAULT, help="PUT: bytes written between removes")
    p.add_argument(
        "--working-set", type=parse_size, default=GET_WORKING_SET_BYTES, help="GET: bytes read round robin (256MiB)"
    )
    p.add_argument("--memory", default="3GiB", help="the local server's memory tier")
    p.add_argument("--server", help="HOST:PORT of a running server (else one is started); see --server-pid")
    p.add_argument("--server-pid", type=int, help="its process id: its CPU per call, and --profile")
    p.add_argument("--out", type=Path, help="profile files and report.json (default: a temp folder)")
    p.add_argument("--floors", action="store_true", help="measure the machine's floors in every round")
    p.add_argument(
        "--baseline",
        metavar="TREE",
        help="A/B instead: this checkout's client against TREE's (another checkout with its gcache/ and "
        "native module), worker processes alternating bursts of --seconds, --runs rounds (client CPU per "
        "call, p50, GB/s: min / median / max, ratio of medians)",
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    args = p.parse_args(argv)
    profilers = [x for x in args.profile.split(",") if x and x != "none"]
    for x in profilers:
        if x not in PROFILERS:
            p.error(f"unknown profiler {x!r}: choose from {PROFILERS}")
    paths = args.path or (["tcp-get", "tcp-put", "shm-put", "shm-get4k"] if not args.floors else [])
    out = args.out or Path(tempfile.mkdtemp(prefix="gcache-prof-"))
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"argv": sys.argv, "paths": {name: {"runs": []} for name in paths}, "floors": []}
    server = None
    loops: dict[str, Loop] = {}
    server_pid = args.server_pid
    tmp = Path(tempfile.mkdtemp(prefix="gcache-prof-server-"))
    try:
        if paths:
            if args.server:
                address = args.server
            else:
                server = start_server(args.memory, tmp)
                address, server_pid = server.address, server.proc.pid
            print(f"server {address} pid {server_pid}; client pid {os.getpid()}; files in {out}", flush=True)
            if args.baseline:
                for name in paths:
                    report["paths"][name]["ab"] = ab_compare(args, address, name)
                paths = []
            for name in paths:
                loops[name] = Loop(
                    address, path_of(name), args.batch, args.value_size, args.small_size, args.live, args.working_set
                )
        # Rounds: the floors, then every path once, so neighbouring figures share the machine's load.
        for rnd in range(args.runs):
            if args.floors:
                fl = floor_round(args.batch * args.value_size)
                report["floors"].append(fl)
                print(f"round {rnd} floors {json.dumps(fl)}", flush=True)
            for name, loop in loops.items():
                r = loop.run(args.seconds, args.ops, server_pid)
                report["paths"][name]["runs"].append(r)
                server_cpu = r["server_cpu_us_per_op"]
                print(
                    f"round {rnd} {name}: {r['ops']} calls, {r['gbps']:.3f} GB/s, p50 {r['p50_us']:.1f} us, "
                    f"p99 {r['p99_us']:.1f} us, CPU per call: client {r['client_cpu_us_per_op']:.1f} us, "
                    f"server {'-' if server_cpu is None else f'{server_cpu:.1f}'} us",
                    flush=True,
                )
        if args.floors:
            floor_shapes = {
                "loopback_tcp_batch": {},
                "loopback_tcp_get_footprint": {"sender_bytes": GET_WORKING_SET_BYTES},
                "loopback_tcp_put_footprint": {"receiver_bytes": PUT_LIVE_BYTES_DEFAULT},
            }
            for kind in profilers:
                for floor, shape in floor_shapes.items():
                    where = out / floor
                    where.mkdir(exist_ok=True)
                    prof = profile_floor(kind, where, args.batch * args.value_size, FLOOR_PROFILE_BATCHES, **shape)
                    report.setdefault("floor_profiles", {}).setdefault(floor, {})[kind] = prof
                    print(f"{floor} [{kind}] {json.dumps(prof, indent=1)}", flush=True)
        for name, loop in loops.items():
            for kind in profilers:
                if server_pid is None:
                    raise SystemExit("--profile with --server needs --server-pid")
                where = out / name
                where.mkdir(exist_ok=True)
                prof = profile_run(kind, loop, server_pid, where, args.seconds, args.ops)
                report["paths"][name][kind] = prof
                print(f"{name} [{kind}] {json.dumps(prof, indent=1)}", flush=True)
    finally:
        for loop in loops.values():
            loop.close()
        if server is not None:
            server.stop()
    print_summary(report)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
