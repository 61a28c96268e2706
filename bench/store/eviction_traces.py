"""Block traces for bench/store/eviction_replay.py and the clairvoyant hit rate on them.

A trace (../shared/data/traces/*.jsonl, Mooncake's format) is one request per line;
`hash_ids` names the request's prompt blocks in order, and equal ids mean equal prefixes
(an id is never seen after two different predecessors), so a request is one prefix chain.

The clairvoyant (Belady) hit rate replays the same calls a KV-cache client makes (probe
the chain, read the hit prefix, put the rest) against a cache of `capacity` blocks that
knows the future: on a miss it evicts the block whose next use is furthest away (deeper
blocks first among equals, so chains lose their tails first), or does not keep the new
block at all if nothing cached is needed later than it. A request hits its longest cached
prefix; the figure is hit blocks / requested blocks, the same as the server replay's.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

NEVER = 1 << 62


@dataclass(frozen=True)
class Trace:
    name: str
    chains: list[list[int]]  # per request: its block ids, in prefix order

    @property
    def unique_blocks(self) -> int:
        return len({b for chain in self.chains for b in chain})

    @property
    def blocks(self) -> int:
        return sum(len(chain) for chain in self.chains)


def load_trace(path: Path, limit: int | None = None) -> Trace:
    """The first `limit` requests of a Mooncake-format trace (all if None)."""
    chains = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(chains) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            record = json.loads(line)
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError(f"{path}: line {len(chains) + 1} has no list of integer hash_ids")
            chains.append(ids)
    name = Path(path).stem.removesuffix("_trace")
    return Trace(name, chains)


def clairvoyant_hit_rate(trace: Trace, capacity: int) -> float:
    """Belady's hit rate (with bypass) for a cache of `capacity` blocks; see the module doc."""
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    flat = [b for chain in trace.chains for b in chain]
    next_use = [NEVER] * len(flat)
    seen: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], NEVER)
        seen[flat[i]] = i
    cached: dict[int, int] = {}  # block -> its next use
    furthest: list[tuple[int, int, int]] = []  # (-next use, -depth, block), stale entries skipped
    hits = position = 0
    for chain in trace.chains:
        prefix_intact = True
        for depth, block in enumerate(chain):
            use = next_use[position]
            position += 1
            if block in cached:
                hits += prefix_intact
            else:
                prefix_intact = False
                if use == NEVER or capacity == 0:
                    continue
                if len(cached) >= capacity:
                    while cached.get(furthest[0][2]) != -furthest[0][0]:
                        heapq.heappop(furthest)
                    if -furthest[0][0] <= use:
                        continue  # everything cached is needed sooner: do not keep this one
                    del cached[heapq.heappop(furthest)[2]]
            cached[block] = use
            heapq.heappush(furthest, (-use, -depth, block))
    return hits / max(1, trace.blocks)
