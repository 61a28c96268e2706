"""bench/store/profile_paths.py on tiny shapes: every path runs against a real gcache-server
with its CPU per call on both sides, the floors report their figures, the A/B mode runs two
trees' workers, and the profile parsers read what strace and perf write.

No timing assertions: only that the figures exist and are positive where they must be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.store import profile_paths

SMALL = ["--batch", "4", "--value-size", "64KiB", "--working-set", "1MiB", "--live", "1MiB", "--memory", "64MiB"]
ROOT = Path(profile_paths.__file__).resolve().parents[2]


@pytest.mark.process
def test_every_path_runs_and_reports_cpu_per_call(tmp_path):
    argv = [*SMALL, "--runs", "2", "--ops", "20", "--out", str(tmp_path)]
    for name in profile_paths.PATHS:
        argv += ["--path", name]
    assert profile_paths.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    for name in profile_paths.PATHS:
        runs = report["paths"][name]["runs"]
        assert len(runs) == 2
        for run in runs:
            assert run["ops"] == 20 and run["gbps"] > 0 and run["p50_us"] > 0
            assert run["client_cpu_us_per_op"] > 0 and run["server_cpu_us_per_op"] >= 0
            assert run["client_user_us_per_op"] + run["client_system_us_per_op"] > 0


@pytest.mark.process
def test_baseline_mode_runs_both_trees(tmp_path):
    argv = [
        *SMALL,
        "--path",
        "tcp-get4k",
        "--baseline",
        str(ROOT),
        "--runs",
        "1",
        "--ops",
        "10",
        "--out",
        str(tmp_path),
    ]
    assert profile_paths.main(argv) == 0
    ab = json.loads((tmp_path / "report.json").read_text())["paths"]["tcp-get4k"]["ab"]
    for side in ("this", "baseline"):
        assert len(ab["runs"][side]) == profile_paths.AB_BURSTS - 1
        assert all(r["ops"] == 10 and r["client_cpu_us_per_op"] > 0 and r["round"] == 0 for r in ab["runs"][side])
    assert "this / baseline per round" in ab["client_cpu_us_per_op"]


def test_round_ratios_pair_each_round_by_its_medians():
    runs = {
        "this": [{"round": 0, "x": 1.0}, {"round": 0, "x": 3.0}, {"round": 0, "x": 2.0}, {"round": 1, "x": 5.0}],
        "baseline": [{"round": 1, "x": 10.0}, {"round": 0, "x": 4.0}, {"round": 0, "x": 8.0}, {"round": 0, "x": 6.0}],
    }
    assert profile_paths.round_ratios(runs, "x") == [2.0 / 6.0, 5.0 / 10.0]


@pytest.mark.process
def test_floors_report_rates_and_cpu():
    loop = profile_paths.loopback(1 << 20, batches=4, sender_bytes=4 << 20)
    assert loop["gbps"] > 0 and loop["sender_cpu_us_per_batch"] >= 0 and loop["receiver_cpu_us_per_batch"] >= 0
    for family in ("tcp", "unix"):
        pong = profile_paths.pingpong(family, rounds=200)
        assert pong["p50_us"] > 0 and pong["client_cpu_us_per_op"] > 0 and pong["server_cpu_us_per_op"] > 0


def test_strace_lines_count_each_call_once(tmp_path):
    trace = tmp_path / "x.strace"
    trace.write_text(
        '101 recvfrom(3, "GCH1"..., 32, MSG_DONTWAIT, NULL, NULL) = 32\n'
        "101 sendmsg(3, {msg_name=NULL, ...}, MSG_NOSIGNAL <unfinished ...>\n"
        "102 poll([{fd=4, events=POLLIN}], 2, 1000 <unfinished ...>\n"
        "101 <... sendmsg resumed>) = 4128\n"
        "102 <... poll resumed>) = 1 ([{fd=4, revents=POLLIN}])\n"
        "102 +++ exited with 0 +++\n"
    )
    per_tid = profile_paths.parse_strace(trace)
    assert per_tid[101] == {"recvfrom": 1, "sendmsg": 1} and per_tid[102] == {"poll": 1}


@pytest.mark.parametrize(
    "dso,sym,category",
    [
        ("[kernel.kallsyms]", "_copy_to_iter", "kernel copy"),
        ("[kernel.kallsyms]", "tcp_sendmsg_locked", "kernel other"),
        ("_native.cpython-311-x86_64-linux-gnu.so", "(anonymous namespace)::copy_streaming", "native copy"),
        ("_native.cpython-311-x86_64-linux-gnu.so", "gcache::copy_bytes", "native copy"),
        (
            "_native.cpython-311-x86_64-linux-gnu.so",
            "gcache::(anonymous namespace)::fused_avx512<(gcache::(anonymous namespace)::Store)2>",
            "native copy+hash (fused)",
        ),
        ("libxxhash.so.0.8.1", "0x0000000000008b08", "native hash"),
        ("libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", "python interpreter"),
        ("_multiarray_umath.cpython-311-x86_64-linux-gnu.so", "UBYTE_equal", "numpy"),
        ("_cmsgpack.cpython-311-x86_64-linux-gnu.so", "unpack_execute", "msgpack"),
        ("libc.so.6", "__memmove_avx512_unaligned_erms", "libc copy"),
    ],
)
def test_perf_symbols_fall_in_their_category(dso, sym, category):
    assert profile_paths.categorize(dso, sym) == category
