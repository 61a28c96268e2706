"""One bench/router/policies.py run per (workload, seed, policy, workers), in a few processes.

Each process owns one real redis-server (started here, stopped at the end by the parent);
a run starts from an empty database (FLUSHDB), builds fresh workers, publishers and
routers, and simulates (bench/router/sim.py). With --l3 each run also gets a fresh
gcache-server as the shared L3.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
from dataclasses import dataclass

from bench.hicache.cluster import Setup, Worker
from bench.hicache.measure import measure_h2d, measure_timing, start_server, stop_server
from bench.hicache.sim import Timing
from bench.router.sim import Cluster, SimConfig, simulate
from bench.router.workloads import poisson_arrivals
from gcache.tools.devcluster.local_redis import LocalRedis

SETUP_L2 = Setup("L1+L2", l2=True)
SETUP_L3 = Setup("L1+L2+L3", l2=True, l3=True)


@dataclass(frozen=True)
class Job:
    workload: str
    seed: int
    policy: str
    workers: int
    scale: float = 1.0  # load sweep point: the workload's rate times this

    @property
    def key(self) -> tuple:
        return (self.workload, self.seed, self.policy, self.workers, self.scale)


_STATE: dict = {}  # what the forked processes read (set before the pool starts)


def measure(st: dict) -> Timing:
    """Copy rates charged on the virtual clock (L2 -> L1 loads; L3 reads with --l3)."""
    cfg = next(iter(st["cfg"].values()))
    if st["args"].l3:
        b = next(iter(st["budgets"].values()))
        t = measure_timing(cfg, b.l3_bytes, int(b.l3_bytes * 0.0625))
        if st["args"].h2d_gbps:
            t = Timing(st["args"].h2d_gbps * 1e9, t.l3_bytes_per_s, t.l3_rtt_s)
        return t
    h2d = st["args"].h2d_gbps * 1e9 or measure_h2d()
    return Timing(h2d_bytes_per_s=h2d, l3_bytes_per_s=1.0, l3_rtt_s=0.0)


def run_job(job: Job) -> tuple:
    st = _STATE
    args = st["args"]
    key = (job.workload, job.seed, job.workers)
    turns, budgets, cfg = st["turns"][key], st["budgets"][key], st["cfg"][job.workload]
    redis_url = st["redis_url"]
    _flush_db(redis_url)
    srv = root = None
    if args.l3:
        srv, root = start_server(budgets.l3_bytes, int(budgets.l3_bytes * 0.0625))
    try:
        max_new = max(t.max_tokens for t in turns)
        setup = SETUP_L3 if args.l3 else SETUP_L2
        workers = [
            Worker(cfg, setup, budgets, st["sched"], st["cost"], st["timing"], srv.address if srv else "", max_new)
            for _ in range(job.workers)
        ]
        sim = SimConfig(tick_s=args.tick_s, routers=args.routers, check_every=args.check_every)
        cluster = Cluster(workers, st["wiring"], redis_url, job.policy, sim, cfg.page_size, cfg.window)
        arrivals = poisson_arrivals(len(turns), st["rate"][job.workload] * job.scale * job.workers, job.seed)
        res = simulate(turns, cluster, job.policy, arrivals)
    except Exception as e:
        raise RuntimeError(f"run {job} failed: {e!r}") from e
    finally:
        if srv is not None:
            stop_server(srv, root)
    return job.key, res


def _flush_db(redis_url: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url, socket_timeout=5) as r:
        r.flushdb()


def _init_process(urls) -> None:
    """Pool processes: take one redis-server of our own; a SIGTERM (the pool ends early
    when a run fails) unwinds the run, so its gcache-server is stopped, not orphaned."""
    _STATE["redis_url"] = urls.get(timeout=30)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))


def parse_knobs(text: str) -> dict:
    """--knobs NAME=VALUE,...: numeric RouterConfig fields, typed like their defaults."""
    from gcache.router.config import RouterConfig

    fields = RouterConfig.__dataclass_fields__
    knobs = {}
    for item in (x for x in text.split(",") if x):
        name, _, value = item.partition("=")
        if name not in fields or not isinstance(fields[name].default, (int, float)):
            raise SystemExit(f"--knobs: {name!r} is not a numeric RouterConfig field")
        knobs[name] = type(fields[name].default)(float(value))
    return knobs


def run_all(jobs: list[Job], st: dict) -> dict:
    from bench.router.wiring import Wiring

    st["wiring"] = Wiring(**parse_knobs(st["args"].knobs))
    st["timing"] = t = measure(st)
    given = "given (--h2d-gbps)" if st["args"].h2d_gbps else "measured now (one 256 MiB numpy copy)"
    l3 = (
        f"; L3 GET {t.l3_bytes_per_s / 1e9:.2f} GB/s + {t.l3_rtt_s * 1e6:.0f} us round trips (measured)"
        if st["args"].l3
        else ""
    )
    print(f"copy charges on the virtual clock: L2 -> L1 loads at {t.h2d_bytes_per_s / 1e9:.2f} GB/s, {given}{l3}")
    given_knobs = f"--knobs {st['args'].knobs}" if st["args"].knobs else "RouterConfig defaults"
    print(f"router knobs ({given_knobs}): {st['wiring'].describe()}")
    _STATE.update(st)
    processes = max(1, min(st["args"].jobs, len(jobs)))
    servers = [LocalRedis() for _ in range(processes)]
    try:
        if processes == 1:
            _STATE["redis_url"] = f"redis://{servers[0].address}/0"
            return dict(run_job(j) for j in jobs)
        ctx = mp.get_context("fork")
        urls = ctx.Queue()
        for s in servers:
            urls.put(f"redis://{s.address}/0")
        # Largest runs first, so the processes finish together.
        order = sorted(jobs, key=lambda j: (-j.workers, j.workload, j.scale, j.seed, j.policy))
        with ctx.Pool(processes, initializer=_init_process, initargs=(urls,)) as pool:
            return dict(pool.imap_unordered(run_job, order))
    finally:
        for s in servers:
            s.stop()
