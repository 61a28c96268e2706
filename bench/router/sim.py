"""N real engines behind a real router, stepped as a discrete-event simulation in virtual
time (bench/router/policies.py's runner).

Each worker is bench/hicache/cluster.py's Worker: a real Engine (scheduler, SWA radix tree,
dual device pools, HostCache as L2, optionally L3Store + gcache.Client on one shared real
gcache-server) whose compute advances its own VirtualClock by the fitted cost of each batch.
Next to it, the real WorkerPublisher writes its state to a real redis-server; the real
RouterCore reads it back. Nothing runs in the background: every `tick_s` of virtual time the
bench calls flush() on each publisher whose worker changed since its last flush, then
refresh() on every router (also every keepalive_s when nothing changed), synchronously, so a
run is deterministic (same seed and copy rate, same figures). Routers and publishers measure
staleness, grace and backoff by the simulation's clock.

Events, earliest first (ties: ticks, then arrivals, then worker steps):
  tick     publishers flush, routers refresh, one load sample (running + waiting per worker);
  arrival  router.pick(prompt) -> worker; router.begin(url); the request joins that worker
           (its clock moves up to the arrival time);
  step     one engine step of the busy worker whose clock is earliest; the publisher's step
           hook runs after it; finished requests -> router.end(url, True) and release the
           conversation's next turn (closed loop per conversation).
A worker's clock may run ahead of the event time by at most one step (the only reordering).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from bench.hicache.cluster import TierHits, Worker, next_events
from bench.hicache.workloads import Turn, first_turns
from gcache.serving.swa_window import last_safe_end
from gcache.wire.keys import page_hashes_array


@dataclass
class RunResult(TierHits):
    policy: str
    workers: int
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    hit_by_tier: dict = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    ttft_s: list = field(default_factory=list)
    recomputed: int = 0
    preemptions: int = 0
    makespan_s: float = 0.0
    busy_s: list = field(default_factory=list)  # per worker: virtual seconds stepping
    served: list = field(default_factory=list)  # per worker: requests routed there
    load_max_sum: float = 0.0  # sum over samples of max_k load_k
    load_mean_sum: float = 0.0  # sum over samples of mean_k load_k
    samples: int = 0
    swa_lost_routes: int = 0  # chosen worker held more full pages than it could use (SWA gone)
    swa_lost_tokens: int = 0  # those unusable tokens, summed
    misroutes: int = 0  # ... and another worker could have served more window-safe tokens
    misroute_tokens: int = 0  # best other window-safe match - chosen's, summed over misroutes
    wall_s: float = 0.0

    @property
    def imbalance(self) -> float:
        """Time-averaged max over time-averaged mean of requests on a worker (running +
        waiting), sampled every tick: 1.0 is perfect balance."""
        return self.load_max_sum / self.load_mean_sum if self.load_mean_sum else 1.0

    @property
    def mean_load(self) -> float:
        """Requests on a worker (running + waiting), averaged over workers and busy samples."""
        return self.load_mean_sum / max(1, self.samples)

    @property
    def work_imbalance(self) -> float:
        """Max over mean of the busy seconds per worker over the whole run."""
        mean = sum(self.busy_s) / max(1, len(self.busy_s))
        return max(self.busy_s) / mean if mean else 1.0

    def ttft(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q)) if self.ttft_s else float("nan")

    @property
    def throughput(self) -> float:
        """Prompt + generated tokens per virtual second of the run (arrival-bound)."""
        return (self.prompt_tokens + self.output_tokens) / max(1e-9, self.makespan_s)

    @property
    def utilisation(self) -> float:
        """Busy worker-seconds / (workers x makespan)."""
        return sum(self.busy_s) / max(1e-9, len(self.busy_s) * self.makespan_s)

    @property
    def capacity(self) -> float:
        """Prompt tokens per busy worker-second: what the same workers could take at
        saturation (hits make a prompt cheaper)."""
        return self.prompt_tokens / max(1e-9, sum(self.busy_s))


@dataclass(frozen=True)
class SimConfig:
    tick_s: float = 0.1  # publish + refresh period (virtual seconds)
    keepalive_s: float = 0.5  # refresh at least this often even when no worker changed
    #                                (a router whose view is older than redis_stale_s, 1 s,
    #                                falls back to least load)
    routers: int = 1  # requests alternate between this many routers
    check_every: int = 0  # engine.check_integrity() every N steps (0: at the end only)


class Probe:
    """What each worker really holds for a prompt, read-only (no LRU touch): window-safe
    tokens loadable from L1+L2 (what HiCache would give), and full-KV tokens present in L1+L2
    whether or not their SWA is still there (what an SWA-unaware view counts)."""

    def __init__(self, page_size: int, window: int) -> None:
        self.ps, self.window = page_size, window

    def __call__(self, cache, tokens: np.ndarray, keys: list[str]) -> tuple[int, int]:
        ps = self.ps
        limit = (len(tokens) - 1) // ps  # leave a token to compute, as HiCache does
        keys = keys[:limit]
        points = cache.tree.checkpoints(tokens[: limit * ps], keys=keys)
        safe = points[-1] // ps if points else 0
        _, present, _ = cache.tree._walk(keys)  # read-only walk: full pages present in L1
        if cache.host is not None:
            n, swa = cache.host.run(keys, safe)
            safe = last_safe_end(safe, n, lambda i: swa[i - safe], ps, self.window)
            present = max(present + cache.host.run(keys, present)[0], cache.host.run(keys, 0)[0])
        return safe * ps, max(present, safe) * ps


class SimTime:
    """The simulation's global clock (the time of the event being processed): what the
    routers and publishers measure staleness, grace and backoff by."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance_to(self, t: float) -> None:
        self.now_s = max(self.now_s, t)


class Cluster:
    """The workers, their publishers, the routers; `wiring` builds the real router parts."""

    def __init__(
        self, workers: list[Worker], wiring, redis_url: str, policy: str, sim: SimConfig, page_size: int, window: int
    ) -> None:
        self.workers = workers
        self.urls = [f"http://sim-worker-{k}:8000" for k in range(len(workers))]
        self.by_url = dict(zip(self.urls, workers))
        self.sim = sim
        self.time = SimTime()
        self.publishers, self.routers = [], []
        try:
            for url, w in zip(self.urls, workers):
                self.publishers.append(wiring.publisher(redis_url, url, w.engine, self.time))
                self.publishers[-1].on_step(w.engine)  # attaches its observers to the cache
            self.flush()  # registered before any router reads
            for i in range(sim.routers):
                self.routers.append(wiring.router(redis_url, policy, self.time, seed=i))
            self.refresh()
        except BaseException:
            self.close()
            raise
        self.probe = Probe(page_size, window)
        self.page_size = page_size
        self.dirty = [False] * len(workers)  # stepped or got a request since its last flush
        self.refreshed_s = 0.0

    def flush(self) -> None:
        for p in self.publishers:
            p.flush()
        self.dirty = [False] * len(self.workers)

    def refresh(self) -> None:
        for r in self.routers:
            r.refresh()
        self.refreshed_s = self.time()

    def tick(self) -> None:
        """Flush the workers that changed (a flush with nothing new writes nothing that a
        router reads), then refresh the routers if any did or the keepalive is due."""
        changed = [k for k, d in enumerate(self.dirty) if d]
        for k in changed:
            self.publishers[k].flush()
            self.dirty[k] = False
        if changed or self.time() - self.refreshed_s >= self.sim.keepalive_s:
            self.refresh()

    def close(self) -> None:
        for r in self.routers:
            r.close()
        for p in self.publishers:
            p.close()
        for w in self.workers:
            w.close()


def simulate(turns: list[Turn], cluster: Cluster, policy: str, arrivals: np.ndarray) -> RunResult:
    """Run every turn through the cluster; `arrivals[i]` is turn i's scheduled virtual time
    (a later turn of a conversation goes when both it is due and the previous one ended)."""
    t0 = time.perf_counter()
    pool, sim = cluster.workers, cluster.sim
    n = len(pool)
    res = RunResult(policy, n, busy_s=[0.0] * n, served=[0] * n)
    heap, next_turns = first_turns(turns, arrivals)
    index_of: dict[tuple[int, int], int] = {}  # (worker, rid) -> turn
    url_of: dict[int, str] = {}  # turn -> worker url
    router_of: dict[int, int] = {}  # turn -> router index
    reqs = []
    next_tick, steps, picks = 0.0, 0, 0
    try:
        while True:
            ta, te, k = next_events(heap, pool)
            if ta == te == float("inf"):
                break
            if next_tick <= min(ta, te):
                cluster.time.advance_to(next_tick)
                _tick(cluster, res)
                next_tick += sim.tick_s
                continue
            if ta <= te:
                _, i = heapq.heappop(heap)
                cluster.time.advance_to(ta)
                turn = turns[i]
                ri = picks % len(cluster.routers)
                picks += 1
                url = _route(cluster, ri, turn, res)
                wk = cluster.urls.index(url)
                r = pool[wk].submit(turn, ta)
                cluster.dirty[wk] = True
                index_of[(wk, r.rid)] = i
                url_of[i], router_of[i] = url, ri
                res.served[wk] += 1
                reqs.append(r)
                continue
            w = pool[k]
            cluster.time.advance_to(te)
            start = w.next_s()
            finished = w.step()
            if w.engine.last_step_ran:
                res.busy_s[k] += w.clock() - start
            cluster.publishers[k].on_step(w.engine)
            cluster.dirty[k] = True
            for r in finished:
                i = index_of.pop((k, r.rid))
                w.finish(r, turns[i])
                cluster.routers[router_of[i]].end(url_of[i], True, len(turns[i].prompt))
                for j in next_turns.get(i, ()):
                    heapq.heappush(heap, (max(float(arrivals[j]), r.finished_s), j))
            steps += 1
            if sim.check_every and steps % sim.check_every == 0:
                w.engine.check_integrity()
        for w in pool:
            w.engine.check_integrity()
    finally:
        cluster.close()
    res.add_requests(reqs)
    res.requests += len(reqs)
    res.output_tokens += sum(len(r.output) for r in reqs)
    res.add_engines(pool)
    res.wall_s = time.perf_counter() - t0
    return res


def _tick(cluster: Cluster, res: RunResult) -> None:
    cluster.tick()
    loads = [len(w.engine.batcher.running) + len(w.engine.scheduler.waiting) for w in cluster.workers]
    if sum(loads):
        res.load_max_sum += max(loads)
        res.load_mean_sum += sum(loads) / len(loads)
        res.samples += 1


def _route(cluster: Cluster, ri: int, turn: Turn, res: RunResult) -> str:
    """router.pick + begin, and the mis-routing account: what the chosen worker could really
    use against what it holds and what the best other worker could have given."""
    router = cluster.routers[ri]
    tokens = turn.prompt
    url = router.pick(tokens)
    if url is None or url not in cluster.by_url:
        raise RuntimeError(f"router {ri} picked {url!r}; workers are {cluster.urls}")
    router.begin(url, len(tokens))
    ps = cluster.page_size
    keys = page_hashes_array(tokens[: len(tokens) // ps * ps], ps)
    held = [cluster.probe(w.cache, tokens, keys) for w in cluster.workers]
    safe, present = held[cluster.urls.index(url)]
    if present > safe:
        res.swa_lost_routes += 1
        res.swa_lost_tokens += present - safe
        best_other = max(s for k, (s, _) in enumerate(held) if cluster.urls[k] != url) if len(held) > 1 else 0
        if best_other > safe:
            res.misroutes += 1
            res.misroute_tokens += best_other - safe
    return url
