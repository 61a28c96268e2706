"""Which hybrid-model states to keep: a trace simulation of reusable prompt tokens (issue 38).

A hybrid model (Qwen3-Next-style: gated-delta-net layers beside a few attention layers)
resumes a prompt at block boundary k only with the attention pages of blocks [0, k) *and*
the recurrent state at exactly k. This replays a Mooncake-format trace
(../shared/data/traces/*.jsonl: `hash_ids` one id per 512-token block, equal ids equal
prefixes) against a cache of values of two kinds:

- a page (one block's attention KV): 1 unit;
- a state at boundary k, keyed by the prefix's last block id: `--state-units` units (default
  6: a Qwen3-Next-80B-like model keeps ~12 MiB of attention KV per 512-token block in its 12
  attention layers, and 36 GDN layers x ~2 MiB of state per boundary = 72 MiB).

Per request, in trace order: the hit is the largest k <= (input_length - 1) // 512 whose
pages [0, k) and state k are all cached (touched on a hit); then the prompt's full blocks'
pages are put, and states by the admission rule:
- `every`: a state at every full boundary (what an engine offering every boundary saves);
- `marconi`: the prompt's last full boundary and the branch point (the deepest boundary whose
  prefix an earlier request already had: a shared prefix seen twice), Marconi's admission;
  at most 2 per request.
Eviction: `lru` (state-unaware, by last use) or `gds` (GreedyDual-Size: priority = clock +
cost / size, cost = the blocks a value lets an engine skip: 1 for a page, k for a state at k;
what the client would tell the node in the PUT, weighed per byte). `clairvoyant` evicts the
value whose next use is furthest away (Belady on next use, sizes ignored in the choice,
bypassing a value needed later than everything cached), under either admission; the better of
the two is the "clairvoyant" reference: strong, but not a proven optimum for variable sizes and
joint hits (a policy can beat it). `infinite` has no capacity limit: the true ceiling.

Capacity: `--fraction` (default 0.1) x the working set (unique pages + unique states under
`every`, in units). Reported: reusable prompt tokens / prompt tokens. Deterministic: one run.

  .venv/bin/python -m bench.store.hybrid_states                 # both traces, ~1 min
  .venv/bin/python -m bench.store.hybrid_states --limit 500     # smoke
"""

from __future__ import annotations

import argparse
import heapq
import json
from bisect import bisect_right
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench.common.paths import TRACE_DIR

BLOCK_TOKENS = 512  # the traces' block size
NEVER = 1 << 62
STATES_PER_REQUEST_MAX = 2  # marconi admission's per-request bound


@dataclass(frozen=True)
class Request:
    input_length: int
    chain: tuple[int, ...]  # block ids, prefix order

    @property
    def hit_blocks_max(self) -> int:  # an engine computes at least the prompt's last token
        return min(len(self.chain), (self.input_length - 1) // BLOCK_TOKENS)

    @property
    def full_blocks(self) -> int:
        return min(len(self.chain), self.input_length // BLOCK_TOKENS)


def load_requests(path: Path, limit: int | None = None) -> list[Request]:
    out = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                r = json.loads(line)
                out.append(Request(int(r["input_length"]), tuple(int(i) for i in r["hash_ids"])))
    return out


def page(block: int) -> tuple[str, int]:
    return ("p", block)


def state(block: int) -> tuple[str, int]:
    return ("s", block)  # the state after the prefix ending in `block`


def admitted_states(req: Request, seen: set[int], rule: str) -> list[int]:
    """Boundaries k (1-based) whose states this request puts."""
    full = req.full_blocks
    if rule == "every":
        return list(range(1, full + 1))
    if rule != "marconi":
        raise ValueError(f"unknown admission rule {rule!r}")
    chosen = {full} if full else set()
    shared = max((k for k in range(1, full + 1) if req.chain[k - 1] in seen), default=0)
    if shared:
        chosen.add(shared)
    return sorted(chosen)[-STATES_PER_REQUEST_MAX:]


class Cache:
    """Values keyed ('p'|'s', block) with sizes in units; `policy` picks the victim."""

    def __init__(self, capacity: float, policy: str, next_use=None):
        self.capacity, self.policy, self.used = capacity, policy, 0.0
        self.lru: OrderedDict = OrderedDict()  # key -> size (lru; also membership for all)
        self.heap: list = []  # gds: (priority, seq, key); clairvoyant: (-next use, seq, key)
        self.prio: dict = {}
        self.clock = 0.0
        self.seq = 0
        self.next_use = next_use  # clairvoyant: key -> next use after now

    def __contains__(self, key) -> bool:
        return key in self.lru

    def _push(self, key, priority: float) -> None:
        self.seq += 1
        self.prio[key] = priority
        heapq.heappush(self.heap, (priority, self.seq, key))

    def touch(self, key, cost: float, now: int) -> None:
        if self.policy == "lru":
            self.lru.move_to_end(key)
        elif self.policy == "gds":
            self._push(key, self.clock + cost / self.lru[key])
        elif self.policy == "clairvoyant":
            self._push(key, -self.next_use(key, now))

    def _victim(self):
        if self.policy == "lru":
            return next(iter(self.lru))
        while True:
            priority, _, key = self.heap[0]
            if key in self.lru and self.prio.get(key) == priority:
                return key
            heapq.heappop(self.heap)

    def put(self, key, size: float, cost: float, now: int) -> None:
        if key in self.lru:
            self.touch(key, cost, now)
            return
        if self.policy == "infinite":
            self.lru[key] = size
            return
        if size > self.capacity:
            return
        mine = self.next_use(key, now) if self.policy == "clairvoyant" else 0
        if self.policy == "clairvoyant" and mine == NEVER:
            return  # never needed again: bypass
        while self.used + size > self.capacity:
            victim = self._victim()
            if self.policy == "clairvoyant" and -self.prio[victim] <= mine:
                return  # everything cached is needed sooner: bypass
            if self.policy == "gds":
                self.clock = self.prio[victim]
            self.used -= self.lru.pop(victim)
            self.prio.pop(victim, None)
        self.lru[key] = size
        self.used += size
        if self.policy == "gds":
            self._push(key, self.clock + cost / size)
        elif self.policy == "clairvoyant":
            self._push(key, -mine)


def future_uses(requests: list[Request]) -> dict:
    """key -> sorted request indices that could use it (within each one's hit range)."""
    uses: dict = defaultdict(list)
    for i, req in enumerate(requests):
        for k in range(1, req.hit_blocks_max + 1):
            uses[page(req.chain[k - 1])].append(i)
            uses[state(req.chain[k - 1])].append(i)
    return uses


def working_set_units(requests: list[Request], state_units: float) -> float:
    blocks = {b for r in requests for b in r.chain[: r.full_blocks]}
    return len(blocks) * (1 + state_units)  # every full block's page and its boundary state


def simulate(requests: list[Request], capacity: float, policy: str, rule: str, state_units: float) -> float:
    """Reusable prompt tokens / prompt tokens."""
    uses = future_uses(requests) if policy == "clairvoyant" else {}

    def next_use(key, now: int) -> int:
        times = uses.get(key, ())
        at = bisect_right(times, now)
        return times[at] if at < len(times) else NEVER

    cache = Cache(capacity, policy, next_use)
    seen: set[int] = set()
    reused = total = 0
    for now, req in enumerate(requests):
        total += req.input_length
        pages_there = 0
        while pages_there < req.hit_blocks_max and page(req.chain[pages_there]) in cache:
            pages_there += 1
        hit = max((k for k in range(pages_there, 0, -1) if state(req.chain[k - 1]) in cache), default=0)
        reused += hit * BLOCK_TOKENS
        for k in range(1, hit + 1):
            cache.touch(page(req.chain[k - 1]), 1.0, now)
        if hit:
            cache.touch(state(req.chain[hit - 1]), float(hit), now)
        for k in range(1, req.full_blocks + 1):
            cache.put(page(req.chain[k - 1]), 1.0, 1.0, now)
        for k in admitted_states(req, seen, rule):
            cache.put(state(req.chain[k - 1]), state_units, float(k), now)
        seen.update(req.chain[: req.full_blocks])
    return reused / max(1, total)


RUNS = (  # (label, eviction, admission)
    ("lru, every boundary", "lru", "every"),
    ("lru, marconi admission", "lru", "marconi"),
    ("gds cost/byte, every boundary", "gds", "every"),
    ("gds cost/byte, marconi admission", "gds", "marconi"),
    ("clairvoyant, every boundary", "clairvoyant", "every"),
    ("clairvoyant, marconi admission", "clairvoyant", "marconi"),
    ("infinite (ceiling)", "infinite", "every"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default="conversation,synthetic")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR, help="where NAME_trace.jsonl lie")
    parser.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    parser.add_argument("--fraction", type=float, default=0.1, help="capacity / working set")
    parser.add_argument("--state-units", type=float, default=6.0, help="a state's size in pages")
    args = parser.parse_args(argv)
    for name in args.traces.split(","):
        requests = load_requests(args.trace_dir / f"{name}_trace.jsonl", args.limit)
        capacity = args.fraction * working_set_units(requests, args.state_units)
        print(
            f"{name}: {len(requests)} requests, capacity {capacity:.0f} units "
            f"({args.fraction:g} x working set; page 1, state {args.state_units:g})"
        )
        rates = {}
        for label, policy, rule in RUNS:
            rates[label] = simulate(requests, capacity, policy, rule, args.state_units)
        lru = rates["lru, every boundary"] or 1e-12
        best = max(rates["clairvoyant, every boundary"], rates["clairvoyant, marconi admission"]) or 1e-12
        for label, rate in rates.items():
            print(
                f"  {label:34s} reusable tokens {rate:7.2%}  x{rate / lru:5.2f} of lru  {rate / best:6.2f} of clairvoyant"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
