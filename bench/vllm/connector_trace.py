"""The throughput workload of bench/vllm/connectors.py: a slice of the conversation trace as
token prompts for two engines, in waves (wave t = every conversation's turn t).

Each trace block id becomes `block_tokens` token ids drawn seeded by the id, so equal block
ids give equal token prefixes on any engine. Round robin: a conversation's turn t goes to
engine (conversation + t) % engines, so every next turn lands on another engine than the
last, and only a shared store (or recompute) gives it the earlier turns' KV.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from bench.router.trace_chats import Conversation, conversations, working_set_blocks
from gcache.testing.vllm_models import VOCAB


def block_tokens_of(block_id: int, n: int) -> list[int]:
    rng = random.Random(block_id * 7919 + 17)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def slice_of(trace: Path, requests: int, max_blocks: int, offset: int = 0) -> list[Conversation]:
    return conversations(trace, requests, offset=offset, max_blocks=max_blocks)


def working_set_tokens(convs: list[Conversation], block_tokens: int) -> int:
    return working_set_blocks(convs) * block_tokens


def waves_for(
    convs: list[Conversation], engines: int, block_tokens: int, max_tokens: int
) -> list[list[list[dict[str, Any]]]]:
    """[engine][wave] -> requests ({"prompt", "max_tokens", "key": (conversation, turn)})."""
    depth = max(len(c.turns) for c in convs)
    out: list[list[list[dict[str, Any]]]] = [[[] for _ in range(depth)] for _ in range(engines)]
    for ci, conv in enumerate(convs):
        for t, turn in enumerate(conv.turns):
            prompt = [tok for b in turn.blocks for tok in block_tokens_of(b, block_tokens)]
            out[(ci + t) % engines][t].append(dict(prompt=prompt, max_tokens=max_tokens, key=[ci, t]))
    return out
