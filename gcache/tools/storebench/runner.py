"""Runs a workload on N threads or processes; runs every system round by round, interleaved,
and combines the rounds into medians."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from gcache.tools.storebench.peers.base import PeerSpec, open_peer
from gcache.tools.storebench.workloads import BARRIER_TIMEOUT_S, RUNNERS, WorkerContext, WorkerResult, WorkloadConfig

PROCESS_JOIN_TIMEOUT_S = 600.0


def _run_one(spec: PeerSpec, name: str, cfg: WorkloadConfig, ctx: WorkerContext) -> WorkerResult:
    peer = open_peer(spec)
    try:
        return RUNNERS[name](peer, cfg, ctx)
    finally:
        peer.close()


def _thread_workers(spec, name, cfg, workers, key_prefix) -> list[WorkerResult]:
    barrier = threading.Barrier(workers)
    results: list[WorkerResult | None] = [None] * workers
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            results[i] = _run_one(spec, name, cfg, WorkerContext(i, f"{key_prefix}/w{i}", barrier))
        except BaseException:
            errors.append(traceback.format_exc())
            barrier.abort()  # release the others instead of hanging them

    threads = [threading.Thread(target=work, args=(i,), name=f"bench-{name}-{i}") for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{spec.kind} {name} worker failed:\n{errors[0]}")
    return results  # type: ignore[return-value]


def _process_main(spec, name, cfg, worker_id, key_prefix, barrier, queue) -> None:
    try:
        result = _run_one(spec, name, cfg, WorkerContext(worker_id, key_prefix, barrier))
        queue.put((worker_id, result, None))
    except BaseException:
        barrier.abort()
        queue.put((worker_id, None, traceback.format_exc()))


def _process_workers(spec, name, cfg, workers, key_prefix) -> list[WorkerResult]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_process_main,
            args=(spec, name, cfg, i, f"{key_prefix}/p{i}", barrier, queue),
            name=f"bench-{name}-{i}",
            daemon=True,
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    results: list[WorkerResult | None] = [None] * workers
    errors: list[str] = []
    try:
        for _ in range(workers):
            worker_id, result, error = queue.get(timeout=PROCESS_JOIN_TIMEOUT_S)
            results[worker_id] = result
            if error:
                errors.append(error)
    finally:
        for p in procs:
            p.join(BARRIER_TIMEOUT_S if not errors else 5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError(f"{spec.kind} {name} worker process failed:\n{errors[0]}")
    return results  # type: ignore[return-value]


def summarize(results: list[WorkerResult], shared_process: bool = False) -> dict:
    """One timed loop across all workers. Rates add up over concurrent workers.
    `shared_process`: the workers are threads of this process, whose CPU clock each
    per-call reading counts for all of them: their sum is divided by the worker count."""
    lat = np.array([s for r in results for s in r.latencies_s] or [0.0]) * 1e6
    gbps = sum(r.bytes / r.seconds for r in results if r.seconds > 0) / 1e9
    calls_per_s = sum(r.calls / r.seconds for r in results if r.seconds > 0)
    keys_per_s = sum(r.keys / r.seconds for r in results if r.seconds > 0)
    calls = sum(r.calls for r in results)
    cpu_s = sum(r.cpu_seconds for r in results) / (len(results) if shared_process else 1)
    return {
        "calls": sum(r.calls for r in results),
        "keys": sum(r.keys for r in results),
        "bytes": sum(r.bytes for r in results),
        "misses": sum(r.misses for r in results),
        "seconds": max(r.seconds for r in results),
        "gbps": gbps,
        "calls_per_s": calls_per_s,
        "keys_per_s": keys_per_s,
        "p50_us": float(np.percentile(lat, 50)),
        "p99_us": float(np.percentile(lat, 99)),
        "mean_us": float(lat.mean()),
        "max_us": float(lat.max()),
        "cpu_us_per_call": cpu_s / calls * 1e6 if calls else 0.0,
        "verified": all(r.verified for r in results),
    }


def run_workload(
    spec: PeerSpec, name: str, cfg: WorkloadConfig, workers: int = 1, mode: str = "threads", key_prefix: str = "bench"
) -> dict:
    if name not in RUNNERS:
        raise ValueError(f"unknown workload {name!r}: choose from {sorted(RUNNERS)}")
    if workers < 1:
        raise ValueError("need at least one worker")
    run = _process_workers if mode == "processes" else _thread_workers
    return summarize(run(spec, name, cfg, workers, key_prefix), shared_process=mode != "processes")


MEDIAN_FIELDS = ("gbps", "calls_per_s", "keys_per_s", "p50_us", "p99_us", "mean_us", "max_us", "cpu_us_per_call")
TOTAL_FIELDS = ("calls", "keys", "bytes", "misses", "seconds")


def spread(values: list[float]) -> list[float]:
    """[min, median, max] of `values` (at least one)."""
    ordered = sorted(values)
    return [ordered[0], statistics.median(ordered), ordered[-1]]


def combine_repeats(runs: list[dict]) -> dict:
    """Rates and latencies: median over the rounds. Counts: totals over the rounds. `runs`
    keeps every round's own figures (each with its `round`)."""
    fields = [f for f in MEDIAN_FIELDS if all(f in r for r in runs)]  # a peer's report may lack one
    out = {f: statistics.median(r[f] for r in runs) for f in fields}
    out.update({f: sum(r[f] for r in runs) for f in TOTAL_FIELDS})
    out["verified"] = all(r["verified"] for r in runs)
    out["spread"] = {f: spread([r[f] for r in runs]) for f in fields}
    out["repeats"] = len(runs)
    out["runs"] = runs
    return out


@dataclass
class System:
    """One store as the rounds see it: `run(workload, key_prefix)` measures one run and
    returns its figures (summarize's dict). `required`: a failure ends the bench (GCache);
    otherwise the system is dropped from later rounds with the reason (a peer)."""

    name: str  # "gcache", "gcache/tcp", "redis", "mooncake"
    run: Callable[[str, str], dict]
    required: bool = False


@dataclass
class Rounds:
    """What run_rounds measured: every run of every system, in the order they ran."""

    runs: dict[str, dict[str, list[dict]]]  # system -> workload -> one dict per round ran
    order: list[dict] = field(default_factory=list)  # {"round", "workload", "system"}, as run
    limits: list[dict] = field(default_factory=list)  # the machine's probes, one dict per round
    failed: dict[str, str] = field(default_factory=dict)  # system -> why it left the rounds


def run_rounds(
    systems: list[System],
    workloads: list[str],
    repeat: int,
    run_tag: str,
    measure_limits: Callable[[], dict] | None = None,
    progress=None,
    planned_step_s: float = 0.0,
    planned_limits_s: float = 0.0,
    say: Callable[[str], None] = lambda msg: None,
) -> Rounds:
    """`repeat` rounds; each measures the machine (measure_limits), then runs every workload
    on every system back to back: round 0 put on gcache, redis, mooncake, round 0 get on
    gcache, redis, mooncake, ..., round 1 put on gcache, ... So the runs a ratio pairs are
    neighbours in time, and a machine that drifts moves both sides of a round alike."""
    out = Rounds(runs={s.name: {w: [] for w in workloads} for s in systems})
    for r in range(repeat):
        if measure_limits is not None:
            if progress is not None:
                progress.step(f"round {r + 1}/{repeat}: machine limits", planned_limits_s)
            out.limits.append(measure_limits())
        for w in workloads:
            for system in systems:
                if system.name in out.failed:
                    continue
                if progress is not None:
                    progress.step(f"round {r + 1}/{repeat}: {system.name} {w}", planned_step_s)
                try:
                    figures = system.run(w, f"{run_tag}/{system.name}/{w}/r{r}")
                except Exception as exc:
                    if system.required:
                        raise
                    reason = f"failed in round {r + 1}, {w}: " + " ".join(f"{type(exc).__name__}: {exc}".split())
                    say(f"{system.name} {reason}; its later runs are skipped")
                    out.failed[system.name] = reason
                    continue
                out.runs[system.name][w].append(dict(figures, round=r))
                out.order.append({"round": r, "workload": w, "system": system.name})
    return out


def local_system(name: str, spec: PeerSpec, cfg: WorkloadConfig, workers: int, mode: str, **kw) -> System:
    """A store this process drives itself (GCache, Redis): each run opens its own peers."""
    return System(name, lambda w, prefix: run_workload(spec, w, cfg, workers, mode, prefix), **kw)


def config_dict(cfg: WorkloadConfig) -> dict:
    return asdict(cfg)
