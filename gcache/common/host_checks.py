"""Host settings that make or break a GCache host (deploy/README.md, "Host checks").

Each check reads files under a root (normally "/", a fake tree in tests), never calls a
command, and returns a CheckResult: OK, WARN (with the fix to run) or UNKNOWN (the setting
could not be read: said so, never an error). `gcache doctor` prints them; gcache-server and
gcache-worker log one warning line per WARN at start, and gcache-server exports every result
as a gauge in /metrics (`gcache_host_check_<name>`: 1 ok, 0 warn, -1 unknown).
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Literal, NamedTuple

# Files a daemon holds besides its connections: the listeners, disk segments, the journal,
# logs, the admin servers' sockets, Python's own.
FD_SLACK = 256
GiB = 1 << 30


class CheckState(enum.IntEnum):
    """A check's outcome; the value is its /metrics gauge."""

    UNKNOWN = -1
    WARN = 0
    OK = 1


class CheckResult(NamedTuple):
    name: str
    state: CheckState
    detail: str  # what was found
    fix: str = ""  # WARN: what to run


class HostNeeds(NamedTuple):
    """What the process on this host will use, which some checks compare against."""

    arena_bytes: int = 0  # gcache-server --memory (0: no arena)
    rdma: bool = False  # the arena is registered with an RDMA device (--rdma-device)
    connections: int = 0  # connections it may hold at once (0: not a server)


class HostFiles:
    """Reads the host's settings from files under `root`: "/" or a fake tree."""

    def __init__(self, root: str | os.PathLike[str] = "/"):
        self.root = Path(root)

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def read(self, absolute: str) -> str | None:
        """The file's text, or None when it cannot be read (missing, no permission)."""
        try:
            return self.path(absolute).read_text()
        except (OSError, UnicodeDecodeError):
            return None


def _unknown(name: str, what: str) -> CheckResult:
    return CheckResult(name, CheckState.UNKNOWN, f"cannot read {what}; not checked")


def check_numa_balancing(files: HostFiles, needs: HostNeeds) -> CheckResult:
    name, path = "numa_balancing", "/proc/sys/kernel/numa_balancing"
    text = files.read(path)
    if text is None or not text.strip().isdigit():
        return _unknown(name, f"{path} (a kernel without NUMA balancing has none)")
    value = int(text.strip())
    if value == 0:
        return CheckResult(name, CheckState.OK, "kernel.numa_balancing=0")
    return CheckResult(
        name,
        CheckState.WARN,
        f"kernel.numa_balancing={value}: the kernel migrates pages between NUMA nodes behind the "
        "engine's placement (10% end to end lost to it in the report GCache follows)",
        "sysctl -w kernel.numa_balancing=0, and kernel.numa_balancing = 0 in /etc/sysctl.d/90-gcache.conf",
    )


def _limits(files: HostFiles, row: str) -> int | None | Literal["unlimited"]:
    """The soft limit of one row of /proc/self/limits: bytes or a count, "unlimited", or None."""
    text = files.read("/proc/self/limits")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(row):
            fields = line[len(row) :].split()
            if not fields:
                return None
            if fields[0] == "unlimited":
                return "unlimited"
            return int(fields[0]) if fields[0].isdigit() else None
    return None


def check_memlock(files: HostFiles, needs: HostNeeds) -> CheckResult:
    name = "memlock"
    if not needs.rdma:
        return CheckResult(name, CheckState.OK, "no RDMA registration (no --rdma-device): not needed")
    soft = _limits(files, "Max locked memory")
    if soft is None:
        return _unknown(name, "/proc/self/limits (Max locked memory)")
    if soft == "unlimited" or soft >= needs.arena_bytes:
        return CheckResult(name, CheckState.OK, f"RLIMIT_MEMLOCK {soft} covers the {needs.arena_bytes} B arena")
    return CheckResult(
        name,
        CheckState.WARN,
        f"RLIMIT_MEMLOCK is {soft} B, below the {needs.arena_bytes} B arena: registering it with the "
        "RDMA device pins it and fails",
        "LimitMEMLOCK=infinity in the systemd unit (ulimit -l unlimited in a shell; "
        "--ulimit memlock=-1 for a container)",
    )


def check_transparent_hugepages(files: HostFiles, needs: HostNeeds) -> CheckResult:
    name, path = "transparent_hugepages", "/sys/kernel/mm/transparent_hugepage/enabled"
    text = files.read(path)
    chosen = None
    if text is not None:
        chosen = next((w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")), None)
    if chosen is None:
        return _unknown(name, path)
    if chosen != "always":
        return CheckResult(name, CheckState.OK, f"transparent_hugepage={chosen}")
    return CheckResult(
        name,
        CheckState.WARN,
        "transparent_hugepage=always: khugepaged compaction stalls the serving threads (latency "
        "spikes) and bloats sparse memory",
        f"echo madvise > {path} (transparent_hugepage=madvise on the kernel command line)",
    )


def check_swap(files: HostFiles, needs: HostNeeds) -> CheckResult:
    name = "swap"
    text = files.read("/proc/swaps")
    if text is None:
        return _unknown(name, "/proc/swaps")
    devices = [line.split() for line in text.splitlines()[1:] if line.strip()]
    if not devices:
        return CheckResult(name, CheckState.OK, "no swap")
    total_kib = sum(int(d[2]) for d in devices if len(d) > 2 and d[2].isdigit())
    swappiness = (files.read("/proc/sys/vm/swappiness") or "?").strip()
    return CheckResult(
        name,
        CheckState.WARN,
        f"swap is on ({len(devices)} device(s), {total_kib >> 20} GiB, vm.swappiness={swappiness}): the "
        "arena and pinned buffers can go to swap, turning memory hits into disk reads",
        "swapoff -a (and drop the swap lines of /etc/fstab), or at least sysctl -w vm.swappiness=1 "
        "and MemorySwapMax=0 in the systemd unit",
    )


def check_open_files(files: HostFiles, needs: HostNeeds) -> CheckResult:
    name = "open_files"
    soft = _limits(files, "Max open files")
    if soft is None:
        return _unknown(name, "/proc/self/limits (Max open files)")
    if needs.connections == 0:
        return CheckResult(name, CheckState.OK, f"RLIMIT_NOFILE {soft} (no connection count to compare)")
    need = needs.connections + FD_SLACK
    if soft == "unlimited" or soft >= need:
        return CheckResult(name, CheckState.OK, f"RLIMIT_NOFILE {soft} covers {needs.connections} connections")
    return CheckResult(
        name,
        CheckState.WARN,
        f"RLIMIT_NOFILE is {soft}, below the {needs.connections} connections the caps allow "
        f"(--connections-max + --preauth-connections-max) plus {FD_SLACK} for files: past it accept() fails",
        f"LimitNOFILE={max(need, 65536)} in the systemd unit (ulimit -n {need} in a shell), or lower --connections-max",
    )


def _cgroup_memory_limit(files: HostFiles) -> int | None | Literal["max"]:
    """This process's memory cgroup limit in bytes, "max" (none), or None (unreadable)."""
    text = files.read("/proc/self/cgroup")
    if text is None:
        return None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            candidates = [f"/sys/fs/cgroup{path.rstrip('/')}/memory.max", "/sys/fs/cgroup/memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [
                f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            ]
        else:
            continue
        for candidate in candidates:
            value = files.read(candidate)
            if value is None:
                continue
            value = value.strip()
            if value == "max":
                return "max"
            if value.isdigit():
                return "max" if int(value) >= 1 << 62 else int(value)  # v1: "no limit" is a huge number
    return None


def check_memfd_limit(files: HostFiles, needs: HostNeeds) -> CheckResult:
    """The arena is a memfd: not under /dev/shm (whose size= does not bound it), but charged to
    the memory cgroup, so memory.max (or RAM) bounds it."""
    name = "memfd_limit"
    if needs.arena_bytes == 0:
        return CheckResult(name, CheckState.OK, "no arena in this process")
    limit = _cgroup_memory_limit(files)
    if limit is None:
        return _unknown(name, "this process's memory cgroup limit (/proc/self/cgroup, /sys/fs/cgroup)")
    if limit == "max":
        return CheckResult(name, CheckState.OK, "no memory cgroup limit on the memfd arena")
    if limit > needs.arena_bytes + GiB:
        return CheckResult(name, CheckState.OK, f"memory cgroup limit {limit} B leaves room over the arena")
    return CheckResult(
        name,
        CheckState.WARN,
        f"the memory cgroup limit is {limit} B and the memfd arena alone is {needs.arena_bytes} B (plus "
        "the index and page cache): filling it gets the process OOM-killed",
        "raise the limit (MemoryMax= in the unit, resources.limits.memory in Kubernetes) above "
        "--memory + a few GiB, or lower --memory",
    )


CHECKS = (
    check_numa_balancing,
    check_memlock,
    check_transparent_hugepages,
    check_swap,
    check_open_files,
    check_memfd_limit,
)


def run_checks(needs: HostNeeds | None = None, root: str | os.PathLike[str] = "/") -> list[CheckResult]:
    files = HostFiles(root)
    return [check(files, needs or HostNeeds()) for check in CHECKS]


def warning_lines(results: list[CheckResult]) -> list[str]:
    """One line per WARN, with its fix (what the daemons log at start)."""
    return [f"host check {r.name}: {r.detail}; fix: {r.fix}" for r in results if r.state == CheckState.WARN]


def gauges(results: list[CheckResult]) -> dict[str, int]:
    """{"host_check_<name>": 1 ok / 0 warn / -1 unknown} for /metrics."""
    return {f"host_check_{r.name}": int(r.state) for r in results}
