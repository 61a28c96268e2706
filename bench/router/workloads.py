"""Request streams of bench/router/policies.py: the generated multi-turn chat (bench/hicache/workloads.py's
chat_turns) and a window of Mooncake's conversation trace, plus the arrival process.

Trace: records [offset, offset + limit) of conversation_trace.jsonl (a seed picks the
offset, so seeds are different slices of the trace). Each 512-token block id becomes
`block_tokens` deterministic tokens (bench.common.workloads.block_token_ids: equal ids, equal tokens);
the prompt is cut at input_length (scaled) and at prompt_tokens_max. A record whose hash ids
start with an earlier record's complete blocks (at least 2: block 0 is a prompt every record
shares) is that conversation's next turn (the earlier record's last, partial block gets a
new id once it is complete): it is sent only after the earlier one finished (closed loop
per conversation, as in the chat). Only prompts are shared: the trace does not say which
later blocks hold an earlier answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.common.workloads import block_token_ids
from bench.hicache.workloads import Turn, chat_turns

__all__ = ["Turn", "chat_turns", "trace_slice", "poisson_arrivals"]


def trace_slice(
    path: Path,
    offset: int,
    limit: int,
    block_tokens: int,
    prompt_tokens_max: int,
    output_tokens_max: int,
    vocab: int = 4096,
) -> list[Turn]:
    records = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= offset + limit:
                break
            if i >= offset:
                records.append(json.loads(line))
    if not records:
        raise ValueError(f"{path} has no records at offset {offset}")
    turns: list[Turn] = []
    last_of: dict[tuple, int] = {}  # complete-block chain -> latest turn that sent it
    for rec in records:
        ids = tuple(int(x) for x in rec["hash_ids"])
        after = extended_turn(last_of, ids)
        tokens = block_token_ids(np.asarray(ids, dtype=np.int64), block_tokens, vocab)
        length = max(1, min(prompt_tokens_max, rec["input_length"] * block_tokens // 512))
        out = int(min(output_tokens_max, max(1, rec["output_length"] * block_tokens // 512)))
        turns.append(Turn(tokens[:length].astype(np.int64), np.zeros(0, dtype=np.int64), out, after))
        complete = rec["input_length"] // 512
        if complete >= 2:
            last_of[ids[:complete]] = len(turns) - 1
    return turns


def extended_turn(last_of: dict[tuple, int], ids: tuple[int, ...]) -> int:
    """The latest earlier record whose block chain this one extends (the longest such chain;
    -1: none). last_of maps each complete-block chain prefix to the latest record that sent it."""
    for n in range(len(ids), 1, -1):
        j = last_of.get(ids[:n])
        if j is not None:
            return j
    return -1


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Scheduled virtual arrival times of n requests at `rate` per second (seeded)."""
    rng = np.random.default_rng(seed + 10_007)
    return np.cumsum(rng.exponential(1.0 / rate, n))
