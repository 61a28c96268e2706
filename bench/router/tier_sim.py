"""A fast, deterministic model of engines with a shared L3, routed by the REAL router policies
(gcache.router.policies), for bench/router/tiers.py.

What is modelled, and how:
  * an engine's own KV memory (L1) is an LRU of whole pages, `l1_pages` each;
  * the shared L3 (GCache behind the connector) is one LRU of pages, `l3_pages`; only engines
    with the connector save to it (every whole prompt page, when their prefill ends) and load
    from it (the pages after their own L1 prefix, contiguous);
  * a prompt costs, per token: L1 `costs.l1` (0), L3 `costs.l3` (0.1: the copy), recomputed
    `costs.recompute` (1); prefill time = cost x `prefill_s_per_token`;
  * an engine is one FIFO prefill server (what makes TTFT grow with load: a request waits for
    the prefills queued before it); decode runs beside it (continuous batching) and only delays
    the conversation's next turn (`decode_s_per_token` x output tokens);
  * the router's view is exact and instant: each candidate's published flags are its L1 (as the
    KV-event translator would publish them), the shared L3 view is the L3's pages, load is its
    queue (waiting, their uncached tokens) and its running requests. The policies are the real
    objects, called as gcache.router.core calls them (choose, then commit).

Not modelled: SWA windows (full attention only), L2, the publish lag, decode's own slowdown.
"""

from __future__ import annotations

import heapq
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gcache.router.config import RouterConfig
from gcache.router.policies import Candidate, Policy, Prompt, make_policy
from gcache.serving.redis_layout import L1_FULL, L3_FULL, Registration, WorkerLoad, id_bytes, page_ids

# the policies compared: name -> RouterConfig fields (report = the seed's formula: no L3 credit)
POLICY_KNOBS: dict[str, dict] = {
    "round_robin": {"policy": "round_robin"},
    "least_load": {"policy": "least_load"},
    "report": {"policy": "cache_aware", "tier_weights": (1.0, 0.8, 0.0)},
    "tier_aware": {"policy": "cache_aware", "tier_weights": (1.0, 0.8, 0.5)},
}


UNUSED_REDIS = "redis://127.0.0.1:1/0"  # RouterConfig wants a source of workers; the policies never read it


@dataclass(frozen=True)
class TierCosts:
    """Prefill cost per prompt token by where its KV comes from (recompute = 1 unit)."""

    l1: float = 0.0
    l3: float = 0.1
    recompute: float = 1.0


@dataclass(frozen=True)
class SimTurn:
    """One request: its prompt's page ids (whole pages), token count, output tokens, and the
    turn it follows (-1: a conversation's first)."""

    ids: tuple[int, ...]
    tokens: int
    output: int
    after: int


@dataclass(frozen=True)
class TierSpec:
    engines: int
    connectors: tuple[bool, ...]  # per engine: runs the GCache connector (saves to / loads from L3)
    l1_pages: int  # per engine
    l3_pages: int  # shared
    page_size: int
    costs: TierCosts = TierCosts()
    prefill_s_per_token: float = 1e-4  # recompute rate: 10k tokens/s
    decode_s_per_token: float = 0.02


@dataclass
class TierResult:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    l1_tokens: int = 0
    l3_tokens: int = 0
    recomputed: int = 0
    prefill_cost: float = 0.0  # sum over requests of the per-token costs
    ttft_s: list = field(default_factory=list)
    served: list = field(default_factory=list)  # per engine: requests routed there

    def ttft(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q)) if self.ttft_s else float("nan")

    @property
    def hit(self) -> float:
        return (self.l1_tokens + self.l3_tokens) / max(1, self.prompt_tokens)


class PageLRU:
    """Whole pages by id, least recently used first; `flags` is the router's view of it (page id
    -> the tier's bit), the mapping itself so policies read it without a copy."""

    def __init__(self, capacity: int, bit: int) -> None:
        self.capacity, self.bit = capacity, bit
        self.flags: OrderedDict[int, int] = OrderedDict()

    def run(self, ids: Sequence[int], start: int, limit: int) -> int:
        """Pages present from `start` on, contiguous, at most up to `limit`."""
        i, get = start, self.flags.get
        while i < limit and get(ids[i]):
            i += 1
        return i - start

    def put(self, ids: Sequence[int]) -> None:
        """Store (or touch) the pages, the prompt's first page most recent last: its suffix is
        evicted before its prefix, as a prefix cache's leaves are."""
        flags = self.flags
        for pid in reversed(ids):
            flags[pid] = self.bit
            flags.move_to_end(pid)
        while len(flags) > self.capacity:
            flags.popitem(last=False)


@dataclass
class _Job:
    turn: int
    arrived_s: float
    uncached_estimate: int  # tokens not in its L1 when it was queued (the published queued_tokens)


class SimEngine:
    def __init__(self, k: int, spec: TierSpec) -> None:
        self.url = f"http://sim-engine-{k}:8000"
        self.connector = spec.connectors[k]
        self.l1 = PageLRU(spec.l1_pages, L1_FULL)
        self.queue: deque[_Job] = deque()
        self.prefilling: _Job | None = None
        self.decoding = 0

    def load(self) -> WorkerLoad:
        running = self.decoding + (self.prefilling is not None)
        return WorkerLoad(running, len(self.queue), sum(j.uncached_estimate for j in self.queue))


def candidates(engines: list[SimEngine], ids: Sequence[int], page_size: int) -> list[Candidate]:
    """What gcache.router.core hands the policy, from the engines as they are now: registration
    (page size, full attention, load), L1 flags, whether it can load the L3 (the connector)."""
    key = id_bytes(ids[0]) if ids else b""
    return [
        Candidate(
            e.url,
            zlib.crc32(key, zlib.crc32(e.url.encode())),  # the core's rendezvous tie-break
            inflight=len(e.queue) + e.decoding + (e.prefilling is not None),
            reg=Registration(e.url, "sim", page_size, 0, "sim", 0, 0, e.load()),
            flags=e.l1.flags,
            loads_l3=e.connector,
        )
        for e in engines
    ]


def policy_knobs(l3_weight: float = 0.5) -> dict[str, dict]:
    """The policies compared, name -> RouterConfig fields; tier_aware with this L3 weight."""
    knobs = {k: dict(v) for k, v in POLICY_KNOBS.items()}
    knobs["tier_aware"]["tier_weights"] = (1.0, 0.8, l3_weight)
    return knobs


def simulate(turns: list[SimTurn], spec: TierSpec, policy_name: str, knobs: dict, arrivals: np.ndarray) -> TierResult:
    """Every turn through the engines, routed by a RouterConfig(**knobs) policy; `arrivals[i]`
    is turn i's scheduled time (a later turn of a conversation goes when both it is due and the
    previous one ended)."""
    # the view is exact and instant: no Redis, no "recently sent" credit
    cfg = RouterConfig(redis_url=UNUSED_REDIS, recent_ttl_s=0.0, page_size=spec.page_size, **knobs)
    policy: Policy = make_policy(cfg)
    engines = [SimEngine(k, spec) for k in range(spec.engines)]
    by_url = {e.url: e for e in engines}
    l3 = PageLRU(spec.l3_pages, L3_FULL)
    ps, costs = spec.page_size, spec.costs
    res = TierResult(policy_name, served=[0] * spec.engines)
    follow: dict[int, list[int]] = {}
    heap: list[tuple[float, int, int, int, int]] = []  # (time, order, kind, turn, engine)
    order = 0
    for i, t in enumerate(turns):
        if t.after < 0:
            heap.append((float(arrivals[i]), order, _ARRIVE, i, -1))
            order += 1
        else:
            follow.setdefault(t.after, []).append(i)
    heapq.heapify(heap)

    def start_next(e: SimEngine, k: int, now: float) -> None:
        nonlocal order
        if e.prefilling is not None or not e.queue:
            return
        job = e.queue.popleft()
        t = turns[job.turn]
        limit = min(len(t.ids), (t.tokens - 1) // ps)  # the engine computes at least one token
        n1 = e.l1.run(t.ids, 0, limit)
        n3 = l3.run(t.ids, n1, limit) if e.connector else 0
        l1_tok, l3_tok = n1 * ps, n3 * ps
        rest = t.tokens - l1_tok - l3_tok
        cost = l1_tok * costs.l1 + l3_tok * costs.l3 + rest * costs.recompute
        res.l1_tokens += l1_tok
        res.l3_tokens += l3_tok
        res.recomputed += rest
        res.prefill_cost += cost
        e.l1.put(t.ids)  # computed (or loaded) now: held until evicted
        e.prefilling = job
        heapq.heappush(heap, (now + cost * spec.prefill_s_per_token, order, _PREFILLED, job.turn, k))
        order += 1

    while heap:
        now, _, kind, i, k = heapq.heappop(heap)
        t = turns[i]
        if kind == _ARRIVE:
            prompt = Prompt(t.tokens, lambda _ps, ids=t.ids: ids, l3.flags, ps, now)
            cands = candidates(engines, t.ids, ps)
            url = policy.choose(prompt, cands).url
            policy.commit(prompt, url)
            e = by_url[url]
            k = engines.index(e)
            res.served[k] += 1
            n1 = e.l1.run(t.ids, 0, len(t.ids))
            e.queue.append(_Job(i, now, t.tokens - n1 * ps))
            start_next(e, k, now)
        elif kind == _PREFILLED:
            e = engines[k]
            job = e.prefilling
            assert job is not None and job.turn == i
            res.ttft_s.append(now - job.arrived_s)
            res.requests += 1
            res.prompt_tokens += t.tokens
            if e.connector:
                l3.put(t.ids)  # the connector's saves land as the prefill ends
            e.prefilling = None
            e.decoding += 1
            heapq.heappush(heap, (now + t.output * spec.decode_s_per_token, order, _FINISHED, i, k))
            order += 1
            start_next(e, k, now)
        else:
            engines[k].decoding -= 1
            for j in follow.get(i, ()):
                heapq.heappush(heap, (max(float(arrivals[j]), now), order, _ARRIVE, j, -1))
                order += 1
    return res


_ARRIVE, _PREFILLED, _FINISHED = 0, 1, 2


def sim_turns(turns, page_size: int) -> list[SimTurn]:
    """bench.router.workloads Turns -> SimTurns (page ids: the router's own, gcache.serving)."""
    return [SimTurn(tuple(page_ids(t.prompt, page_size)), len(t.prompt), int(t.max_tokens), t.after) for t in turns]


def working_set_pages(turns: list[SimTurn]) -> int:
    return len({pid for t in turns for pid in t.ids})


def connectors_for(scenario: str, engines: int) -> tuple[bool, ...]:
    """all: every engine runs the connector; half: the first half does (a mixed fleet)."""
    if scenario == "all":
        return (True,) * engines
    if scenario == "half":
        return tuple(k < engines // 2 for k in range(engines))
    raise ValueError(f"unknown scenario {scenario!r} (all, half)")
