"""gcache.common.host_checks against fake /proc and /sys trees written in tmp dirs (issue 21,
finding 7): each setting bad, good, and unreadable; plus one run against this host's real
files, which must answer every check without raising."""

from __future__ import annotations

from pathlib import Path

import pytest

from gcache.common.host_checks import (
    CHECKS,
    FD_SLACK,
    CheckState,
    HostNeeds,
    gauges,
    run_checks,
    warning_lines,
)

GiB = 1 << 30
LIMITS_HEADER = "Limit                     Soft Limit           Hard Limit           Units     \n"


def write(root: Path, absolute: str, text: str) -> None:
    path = root / absolute.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def limits(open_files="65536", memlock="unlimited") -> str:
    return (
        LIMITS_HEADER
        + f"Max open files            {open_files:<20} 1048576              files     \n"
        + f"Max locked memory         {memlock:<20} unlimited            bytes     \n"
    )


def good_host(root: Path) -> Path:
    write(root, "/proc/sys/kernel/numa_balancing", "0\n")
    write(root, "/proc/self/limits", limits())
    write(root, "/sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    write(root, "/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
    write(root, "/proc/self/cgroup", "0::/system.slice/gcache-server.service\n")
    write(root, "/sys/fs/cgroup/system.slice/gcache-server.service/memory.max", "max\n")
    return root


NEEDS = HostNeeds(arena_bytes=8 * GiB, rdma=True, connections=1024 + 256)


def by_name(results) -> dict:
    return {r.name: r for r in results}


def test_a_good_host_passes_every_check(tmp_path):
    results = run_checks(NEEDS, good_host(tmp_path))
    assert [r.name for r in results] == [c.__name__.removeprefix("check_") for c in CHECKS]
    assert {r.name: r.state for r in results} == {r.name: CheckState.OK for r in results}
    assert warning_lines(results) == []
    assert set(gauges(results).values()) == {1}


def test_an_empty_root_says_each_setting_is_unreadable_and_is_not_an_error(tmp_path):
    results = by_name(run_checks(NEEDS, tmp_path))
    for name in ("numa_balancing", "memlock", "transparent_hugepages", "swap", "open_files", "memfd_limit"):
        assert results[name].state == CheckState.UNKNOWN, results[name]
        assert results[name].detail.startswith("cannot read ") and results[name].detail.endswith("; not checked")
    assert warning_lines(list(results.values())) == []
    assert set(gauges(list(results.values())).values()) == {-1}


@pytest.mark.parametrize(
    ("absolute", "text", "check", "fix"),
    [
        ("/proc/sys/kernel/numa_balancing", "1\n", "numa_balancing", "sysctl -w kernel.numa_balancing=0"),
        ("/proc/self/limits", limits(memlock="65536"), "memlock", "LimitMEMLOCK=infinity"),
        ("/sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n", "transparent_hugepages", "madvise"),
        (
            "/proc/swaps",
            "Filename Type Size Used Priority\n/swap.img file 8388604 0 -2\n",
            "swap",
            "swapoff -a",
        ),
        ("/proc/self/limits", limits(open_files="1024"), "open_files", f"ulimit -n {1280 + FD_SLACK}"),
        (
            "/sys/fs/cgroup/system.slice/gcache-server.service/memory.max",
            f"{8 * GiB}\n",
            "memfd_limit",
            "MemoryMax=",
        ),
    ],
)
def test_each_bad_setting_is_one_warning_line_with_its_fix(tmp_path, absolute, text, check, fix):
    root = good_host(tmp_path)
    write(root, absolute, text)
    results = run_checks(NEEDS, root)
    lines = warning_lines(results)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"host check {check}: ")
    assert "; fix: " in lines[0] and fix in lines[0].split("; fix: ")[1]
    assert gauges(results)[f"host_check_{check}"] == 0
    assert sum(v == 1 for v in gauges(results).values()) == len(CHECKS) - 1


def test_memlock_and_memfd_matter_only_for_what_the_process_uses(tmp_path):
    root = good_host(tmp_path)
    write(root, "/proc/self/limits", limits(memlock="65536"))
    write(root, "/sys/fs/cgroup/system.slice/gcache-server.service/memory.max", f"{GiB}\n")
    results = by_name(run_checks(HostNeeds(arena_bytes=0, rdma=False, connections=0), root))
    assert results["memlock"].state == CheckState.OK and "not needed" in results["memlock"].detail
    assert results["memfd_limit"].state == CheckState.OK


def test_cgroup_v1_memory_limit(tmp_path):
    root = good_host(tmp_path)
    write(root, "/proc/self/cgroup", "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n")
    write(root, "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{4 * GiB}\n")
    assert by_name(run_checks(NEEDS, root))["memfd_limit"].state == CheckState.WARN
    write(root, "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n")  # no limit
    assert by_name(run_checks(NEEDS, root))["memfd_limit"].state == CheckState.OK


def test_this_hosts_real_files_answer_every_check():
    results = run_checks(NEEDS)
    assert len(results) == len(CHECKS)
    for r in results:
        assert r.state in (CheckState.OK, CheckState.WARN, CheckState.UNKNOWN)
        assert r.detail and (r.state != CheckState.WARN or r.fix)


def test_gcache_doctor_prints_each_check_and_exits_1_on_a_warning(tmp_path, capsys):
    from gcache.cli.main import main

    root = good_host(tmp_path)
    assert main(["doctor", "--root", str(root), "--memory", "8GiB", "--rdma"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [["ok", f"{c.__name__.removeprefix('check_')}:"] for c in CHECKS]
    write(root, "/proc/sys/kernel/numa_balancing", "1\n")
    (root / "proc/swaps").unlink()
    assert main(["doctor", "--root", str(root), "--memory", "8GiB"]) == 1
    out = capsys.readouterr().out
    assert "WARN numa_balancing: kernel.numa_balancing=1" in out
    assert "fix: sysctl -w kernel.numa_balancing=0" in out
    assert "?    swap: cannot read /proc/swaps; not checked" in out
    assert main(["doctor", "--memory", "lots"]) == 2
