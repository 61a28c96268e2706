"""2 prefill + 2 decode engines vs 4 mixed ones, in virtual time on the fitted compute clock.

Every worker is a real Engine (scheduler, SWA radix tree, dual device pools, a real
HostCache as L2) over SimulatedModel, whose compute advances the worker's own VirtualClock
by the fitted cost of each batch (bench/worker/ttft_cost.py). Events, earliest first:
  arrival   mixed: to the least-loaded mixed worker. PD: to the least-loaded prefill worker,
            as a max_tokens=1 request;
  prefill   done (its first token): the handoff is written to L3 over the prefill worker's
            link (FIFO, --link-gbs), then read over the decode worker's link into reserved
            host slots (host pre-allocation, what gcache-worker --role decode does) or into
            device pages taken when the read starts (device pre-allocation, the baseline
            the production report fixed); the client's TTFT is the first token plus the
            L3 write (gcache's prefill answers once its pages are stored);
  handoff   landed: the pages are published in the decode worker's L2 (as an L3 prefetch
            does), the request joins its engine with its first token handed over, and is
            admitted (device pages) when the scheduler gets to it;
  step      one step of the busy worker whose clock is earliest.
A read whose host slots or device pages are not free waits (FIFO per decode worker) until a
step frees some. Nothing is random but the seeded workload, so a rerun gives the same figures.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from gcache.common.attention import AttentionKind
from gcache.serving.swa_window import tail_start_page
from gcache.serving.tiers import Tier
from gcache.wire.keys import page_hashes_array
from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import RequestState, SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.sim import CostModel, SimulatedModel, VirtualClock


@dataclass(frozen=True)
class Job:
    prompt: np.ndarray
    max_tokens: int
    arrival_s: float
    long: bool  # a long-prompt request (else decode-heavy)


@dataclass(frozen=True)
class Setup:
    full_pages: int  # device pool per worker
    swa_pages: int
    l2_bytes: int  # host pool per worker
    link_gbs: float  # GB/s of each worker's link to L3 (write and read)
    chunk_tokens: int = 512
    max_tokens_per_step: int = 1024
    max_running: int = 64
    pd_min_prompt_tokens: int = 0  # PD: shorter prompts go straight to a decode worker (the router's bypass)


@dataclass
class Result:
    mode: str
    ttft_s: list = field(default_factory=list)
    tpot_s: list = field(default_factory=list)
    ttft_long_s: list = field(default_factory=list)
    tpot_short_s: list = field(default_factory=list)
    handoff_bytes: int = 0
    handoff_tokens: int = 0
    transfer_s: float = 0.0
    held_peak: int = 0  # device pages held by handoffs in flight (device pre-allocation), all decode workers
    held_page_s: float = 0.0  # integral of those pages over time
    host_peak: int = 0  # host slots held by handoffs in flight
    preemptions: int = 0
    makespan_s: float = 0.0
    running_samples: list = field(default_factory=list)  # decode workers' running requests at each step

    def q(self, values: list, p: float) -> float:
        return float(np.percentile(values, p)) if values else float("nan")

    @property
    def held_mean(self) -> float:
        return self.held_page_s / self.makespan_s if self.makespan_s else 0.0


class SimWorker:
    def __init__(self, cfg: ModelConfig, setup: Setup, cost: CostModel, max_new: int) -> None:
        self.clock = VirtualClock()
        self.kv = DualKVCache(cfg, setup.full_pages, setup.swa_pages)
        hc = TieredCacheConfig(
            l2_bytes=setup.l2_bytes, model_name="bench-pd", prefetch_policy="best_effort", write_policy="write_back"
        )
        sc = SchedulerConfig(
            chunk_tokens=setup.chunk_tokens,
            max_tokens_per_step=setup.max_tokens_per_step,
            max_running=setup.max_running,
        )
        ec = EngineConfig(max_prompt_tokens=1 << 20, max_new_tokens=max_new, scheduler=sc, cache_config=hc)
        self.engine = Engine(SimulatedModel(cfg, self.clock, cost), self.kv, ec, clock=self.clock)
        self.host = self.engine.cache.host
        self.link_free_s = 0.0
        self.waiting_reads: list = []  # handoffs whose read waits for slots / pages (FIFO)
        self.prealloc_queue: list = []  # device pre-allocation: handoffs waiting for device pages (FIFO)

    def load(self) -> float:
        s = self.engine.scheduler
        running = self.engine.batcher.running
        queued = sum(r.uncached_estimate for r in s.waiting) + sum(r.to_compute for r in running if r.output == [])
        return len(running) + len(s.waiting) + queued / 2048

    def busy(self) -> bool:
        return self.engine.has_work()

    def link(self, start_s: float, nbytes: int, gbs: float) -> float:
        """A transfer of nbytes over this worker's link, FIFO; returns its end time."""
        begin = max(start_s, self.link_free_s)
        self.link_free_s = begin + nbytes / (gbs * 1e9)
        return self.link_free_s


def handoff_bytes(cfg: ModelConfig, n_tokens: int) -> tuple[int, int, int]:
    """(full pages, SWA tail pages, bytes) a prefill of n_tokens hands over."""
    ps = cfg.page_size
    n = n_tokens // ps
    tail = n - tail_start_page(n, ps, cfg.window)
    return (
        n,
        tail,
        n * DualKVCache.page_bytes(cfg, AttentionKind.FULL) + tail * DualKVCache.page_bytes(cfg, AttentionKind.SWA),
    )


def run(
    cfg: ModelConfig,
    jobs: list[Job],
    setup: Setup,
    cost: CostModel,
    mode: str,
    n_workers: int = 4,
    max_new: int = 4096,
    n_prefill: int | None = None,
) -> Result:
    """mode: mixed | pd_host | pd_device; PD: n_prefill of the n_workers prefill (default half)."""
    pd = mode != "mixed"
    workers = [SimWorker(cfg, setup, cost, max_new) for _ in range(n_workers)]
    k = n_workers // 2 if n_prefill is None else n_prefill
    pre, dec = (workers[:k], workers[k:]) if pd else (workers, [])
    res = Result(mode)
    meta: dict = {}  # rid -> (job, first_token_s | None, worker)
    pins: dict = {}  # rid -> (request, host keys pinned for it until admission)
    prealloc: dict = {}  # device pre-allocation: id(job) -> [decode worker, job, device pages | None]
    handoffs: list = []  # heap of (land_s, seq, worker index, job, first token, first_s, held)
    seq = 0
    held_now = 0
    last_t = 0.0
    arrivals = sorted(jobs, key=lambda j: j.arrival_s)
    ai = 0

    def account(t: float) -> None:
        nonlocal last_t
        if t > last_t:
            res.held_page_s += held_now * (t - last_t)
            last_t = t

    def alloc_device(w: SimWorker, n: int, tail: int):
        """n full + tail SWA device pages (evicting cold cache first), or None."""
        for attempt in range(2):
            dev = (w.kv.full.alloc(n), w.kv.swa.alloc(tail))
            if dev[0] is not None and dev[1] is not None:
                return dev
            for pool, got in zip((w.kv.full, w.kv.swa), dev):
                if got is not None:
                    pool.free(got)
            if attempt == 0:
                w.engine.cache.evict(n, tail)
        return None

    def try_prealloc(di: int, now: float) -> None:
        """Device pre-allocation (the baseline): pages for a handoff are taken on its decode
        worker when the request arrives (FIFO), held through prefill and transfer."""
        nonlocal held_now
        w = dec[di]
        while w.prealloc_queue:
            key = w.prealloc_queue[0]
            job = prealloc[key][1]
            n, tail, _ = handoff_bytes(cfg, len(job.prompt))
            dev = alloc_device(w, n, tail)
            if dev is None:
                return  # wait for a step to free pages
            account(now)
            held_now += n + tail
            res.held_peak = max(res.held_peak, held_now)
            prealloc[key][2] = dev
            w.prealloc_queue.pop(0)

    def start_reads(di: int, now: float) -> None:
        nonlocal seq
        w = dec[di]
        while w.waiting_reads:
            job, first, first_s, ready_s = w.waiting_reads[0]
            n, tail, nbytes = handoff_bytes(cfg, len(job.prompt))
            held = None
            if mode == "pd_device":
                held = prealloc[id(job)][2]
                if held is None:
                    return  # its device pages are not allocated yet
            slots = w.host.reserve(AttentionKind.FULL, n) if held is None else []
            swa = (w.host.reserve(AttentionKind.SWA, tail) if slots is not None else None) if held is None else []
            if swa is None:
                if slots is not None:
                    w.host.cancel(AttentionKind.FULL, slots)
                return  # host slots short: wait for a step to release some
            w.waiting_reads.pop(0)
            land = w.link(max(now, ready_s), nbytes, setup.link_gbs)
            res.transfer_s += nbytes / (setup.link_gbs * 1e9)
            res.host_peak = max(res.host_peak, sum(len(x[6][0]) for x in handoffs) + len(slots))
            heapq.heappush(handoffs, (land, seq, di, job, first, first_s, (slots, swa), held))
            seq += 1

    def land(item) -> None:
        nonlocal held_now
        t, _, di, job, first, first_s, (slots, swa), held = item
        w = dec[di]
        w.clock.advance_to(t)
        ps = cfg.page_size
        keys = page_hashes_array(job.prompt, ps)
        if held is not None:
            # Device pre-allocation: the pages were the read's target. The engine takes a
            # request's pages at admission, so they go back to the pool here and the handoff
            # arrives through L2 like the host path (same admission, the held time differs).
            account(t)
            w.kv.full.free(held[0])
            w.kv.swa.free(held[1])
            held_now -= len(held[0]) + len(held[1])
            n, tail, _ = handoff_bytes(cfg, len(job.prompt))
            slots, swa = w.host.reserve(AttentionKind.FULL, n), w.host.reserve(AttentionKind.SWA, tail)
            if slots is None or swa is None:
                raise RuntimeError("bench: L2 too small for the device pre-allocation path's staging")
        lo = len(keys) - len(swa)
        for i, k in enumerate(keys):  # what an L3 prefetch publishes (pinned for its request, as it does)
            w.host.publish(k, slots[i], swa[i - lo] if i >= lo else None, origin=Tier.L3, in_l3=True, pin=True)
        r = w.engine.add_request(job.prompt, SamplingParams(max_tokens=job.max_tokens), handed=(first,))
        meta[r.rid] = (job, first_s, w)
        pins[r.rid] = (r, keys, w)

    def unpin_admitted(w: SimWorker) -> None:
        for rid, (r, keys, pw) in list(pins.items()):
            if pw is w and r.state is not RequestState.WAITING:  # admitted: its pages were loaded
                w.host.unpin(keys)
                del pins[rid]

    def submit(w: SimWorker, job: Job, t: float, max_tokens: int) -> None:
        w.clock.advance_to(t)
        r = w.engine.add_request(job.prompt, SamplingParams(max_tokens=max_tokens))
        meta[r.rid] = (job, None, w)

    stalled: set = set()  # workers whose last step ran nothing (pages short): not stepped until something changes

    def unstall(t: float) -> None:
        for w in workers:
            if id(w) in stalled:
                w.clock.advance_to(t)  # it waited (idle) until this event
        stalled.clear()

    while True:
        busy = [w for w in workers if w.busy() and id(w) not in stalled]
        t_arr = arrivals[ai].arrival_s if ai < len(arrivals) else float("inf")
        t_hand = handoffs[0][0] if handoffs else float("inf")
        t_step = min((w.clock() for w in busy), default=float("inf"))
        t = min(t_arr, t_hand, t_step)
        if t == float("inf"):
            if any(w.busy() for w in workers):
                raise RuntimeError(f"bench: {mode} deadlocked (every busy worker short of pages)")
            break
        if t != t_step:
            unstall(t)  # an arrival or a landing may free or need pages
        if t == t_arr:
            job = arrivals[ai]
            ai += 1
            bypass = pd and len(job.prompt) < setup.pd_min_prompt_tokens
            pool = dec if bypass else pre if pd else workers
            w = min(pool, key=lambda x: (x.load(), workers.index(x)))
            submit(w, job, t, 1 if pd and not bypass else job.max_tokens)
            if mode == "pd_device" and not bypass:  # the baseline picks the decode worker now
                di = min(range(len(dec)), key=lambda i: (dec[i].load() + len(dec[i].prealloc_queue), i))
                prealloc[id(job)] = [di, job, None]
                dec[di].prealloc_queue.append(id(job))
                try_prealloc(di, t)
        elif t == t_hand:
            land(heapq.heappop(handoffs))
        else:
            w = min(busy, key=lambda x: x.clock())
            done = w.engine.step()
            if w.engine.last_step_ran:
                unstall(w.clock())  # its step may have freed pages another worker waits for
            else:
                stalled.add(id(w))
            for r in done:
                job, first_s, _ = meta.pop(r.rid)
                if pd and w in pre:  # a prefill: hand it to the least-loaded decode worker
                    n, tail, nbytes = handoff_bytes(cfg, len(job.prompt))
                    written = w.link(r.finished_s, nbytes, setup.link_gbs)
                    res.ttft_s.append(written - job.arrival_s)
                    if job.long:
                        res.ttft_long_s.append(written - job.arrival_s)
                    res.handoff_bytes += nbytes
                    res.handoff_tokens += n * cfg.page_size
                    res.transfer_s += nbytes / (setup.link_gbs * 1e9)
                    if job.max_tokens == 1:
                        continue
                    di = (
                        prealloc[id(job)][0]
                        if mode == "pd_device"
                        else min(range(len(dec)), key=lambda i: (dec[i].load() + len(dec[i].waiting_reads), i))
                    )
                    dec[di].waiting_reads.append((job, r.output[0], written, written))
                    start_reads(di, written)
                    continue
                first = r.first_token_s if first_s is None else first_s
                if first_s is None:
                    res.ttft_s.append(first - job.arrival_s)
                    if job.long:
                        res.ttft_long_s.append(first - job.arrival_s)
                if len(r.output) > 1:
                    tpot = (r.finished_s - first) / (len(r.output) - 1)
                    res.tpot_s.append(tpot)
                    if not job.long:
                        res.tpot_short_s.append(tpot)
                res.makespan_s = max(res.makespan_s, r.finished_s)
            if w in dec:
                unpin_admitted(w)
                res.running_samples.append(len(w.engine.batcher.running))
                if mode == "pd_device":
                    try_prealloc(dec.index(w), w.clock())
                start_reads(dec.index(w), w.clock())
    account(res.makespan_s)
    res.preemptions = sum(int(w.engine.metrics.snapshot().get("preemptions_total", 0)) for w in workers)
    return res


def workload(n: int, rate: float, seed: int, long_share: float, long_range=(8192, 30720)) -> list[Job]:
    """Poisson arrivals; long prompts (8k-30k tokens, 32-128 out) among decode-heavy requests
    (256-1024 tokens in, 256-512 out). Prompts are distinct (no shared prefix): PD alone is measured."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    jobs = []
    for i in range(n):
        long = rng.random() < long_share
        plen = int(rng.integers(*long_range)) if long else int(rng.integers(256, 1024))
        out = int(rng.integers(32, 128)) if long else int(rng.integers(256, 512))
        prompt = rng.integers(3, 4000, size=plen).astype(np.int64)
        jobs.append(Job(prompt, out, float(t[i]), long))
    return jobs
