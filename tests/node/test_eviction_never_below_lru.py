"""The chain policy never below LRU (issue 21, finding 6): its tuner has plain LRU among
its candidates and becomes it where LRU wins.

In process, through the node's Store (the server's storage engine), with the calls a
KV-cache client makes per request (probe the chain, read the hit prefix, put the rest).
"""

from __future__ import annotations

import random

import pytest

from gcache._native import Store

PAGE = 4096
VALUE = bytes(range(256)) * 16


def replay(chains, memory_values: int, policy: str, from_request: int = 0) -> tuple[float, dict]:
    """(hit rate over the requests from `from_request` on, the store's stats at the end)."""
    s = Store(memory_values * PAGE, 0, "", eviction_policy=policy)
    hits = asked = 0
    for n, ids in enumerate(chains):
        keys = [b"b%d" % i for i in ids]
        _, prefix = s.exists(keys)
        got = 0
        while got < prefix and s.get(keys[got]) is not None:
            got += 1
        if n >= from_request:
            hits, asked = hits + got, asked + len(keys)
        if got < len(keys):
            s.put_batch(keys[got:], [VALUE] * (len(keys) - got))
    s.check_integrity()
    stats = s.stats()
    s.close()
    return hits / asked, stats


def round_robin_sessions(requests: int, sessions: int = 8) -> list[list[int]]:
    """Adversarial for chain's ordering: sessions in round robin, each turn its whole
    history plus 2 new blocks, then 1 output block; the batch's last value (first in
    line under chain) is exactly what that session's next turn needs."""
    next_id = 0

    def take(n):
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    history = [take(8) for _ in range(sessions)]
    out = []
    while len(out) < requests:
        k = len(out) % sessions
        chain = history[k] + take(2)
        out.append(chain)
        history[k] = chain + take(1) if len(chain) < 120 else take(8)
    return out


def shared_prompt_sessions(requests: int, seed: int) -> list[list[int]]:
    """Agent sessions over a few long shared tool prompts, short turns (chain's home ground)."""
    rng = random.Random(seed)
    next_id = 0

    def take(n):
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    prompts = [take(rng.randint(40, 80)) for _ in range(4)]
    sessions = [list(rng.choice(prompts)) for _ in range(40)]
    out = []
    while len(out) < requests:
        k = rng.randrange(len(sessions))
        chain = sessions[k] + take(rng.randint(1, 4))
        out.append(chain)
        sessions[k] = chain + take(rng.randint(1, 3))
        if len(sessions[k]) > 300 or rng.random() < 0.03:
            sessions[k] = list(rng.choice(prompts))
    return out


def unique(chains) -> int:
    return len({b for c in chains for b in c})


def test_on_a_trace_adversarial_for_chain_the_tuner_stays_lru_and_matches_it():
    chains = round_robin_sessions(3000)
    memory = unique(chains) // 4
    chain_rate, stats = replay(chains, memory, "chain")
    lru_rate, _ = replay(chains, memory, "lru")
    assert stats["eviction_tuner_lru"] == 1, "the tuner kept plain LRU"
    assert stats["eviction_tuner_epochs"] > 10  # it decided, many times
    # Before: chain 0.9395 vs LRU 0.9509 (0.988x). Now LRU's hits, request for request.
    assert chain_rate >= lru_rate, (chain_rate, lru_rate)


@pytest.mark.parametrize("seed", [0, 1])
def test_where_chain_wins_the_tuner_keeps_chain(seed):
    # 800 requests: chain wins by 1.13-1.22x on seeds 0-3 (1500: 1.02-1.14x, 3x the time)
    chains = shared_prompt_sessions(800, seed)
    memory = unique(chains) // 10
    chain_rate, stats = replay(chains, memory, "chain")
    lru_rate, _ = replay(chains, memory, "lru")
    assert chain_rate > lru_rate * 1.02, (chain_rate, lru_rate)
    assert stats["eviction_tuner_lru"] == 0
