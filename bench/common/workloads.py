"""Request streams for the hit-rate bench: a seeded multi-turn chat workload and a replay of
Mooncake's conversation trace. A request is (prompt tokens, tokens to cache afterwards)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Request:
    prompt: np.ndarray  # int64 token ids
    cached: np.ndarray  # what the engine caches when the request ends (prompt + output)


def chat_workload(
    seed: int = 0,
    conversations: int = 300,
    system_prompts: int = 4,
    system_tokens=(600, 1500),
    turns_mean: float = 4.0,
    user_tokens=(30, 300),
    output_tokens=(50, 400),
    concurrency: int = 16,
    vocab: int = 4096,
):
    """Conversations share one of a few system prompts; turn t's prompt is the system prompt,
    every earlier user message and answer, and a new user message. `concurrency`
    conversations are open at once and a random one speaks next."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, rng.integers(*system_tokens)) for _ in range(system_prompts)]
    started, open_convs = 0, []

    def new_conv():
        turns = 1 + rng.geometric(1.0 / turns_mean)
        return {"history": systems[rng.integers(system_prompts)], "turns_left": int(turns)}

    while started < conversations or open_convs:
        while started < conversations and len(open_convs) < concurrency:
            open_convs.append(new_conv())
            started += 1
        k = int(rng.integers(len(open_convs)))
        conv = open_convs[k]
        user = rng.integers(0, vocab, rng.integers(*user_tokens))
        answer = rng.integers(0, vocab, rng.integers(*output_tokens))
        prompt = np.concatenate([conv["history"], user])
        cached = np.concatenate([prompt, answer])
        yield Request(prompt, cached)
        conv["history"], conv["turns_left"] = cached, conv["turns_left"] - 1
        if not conv["turns_left"]:
            open_convs.pop(k)


def block_token_ids(hash_ids: np.ndarray, block_tokens: int, vocab: int) -> np.ndarray:
    """Deterministic pseudo-random tokens per (block hash id, offset): equal ids give equal
    tokens, so shared trace blocks become shared token prefixes (splitmix64)."""
    x = (
        hash_ids.astype(np.uint64)[:, None] * np.uint64(block_tokens)
        + np.arange(block_tokens, dtype=np.uint64)[None, :]
    ).ravel()
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab)).astype(np.int64)


def trace_workload(path: Path, limit: int, block_tokens: int = 512, vocab: int = 4096):
    """Mooncake trace records in arrival order: hash_ids name 512-token prefix blocks;
    each block becomes `block_tokens` synthetic tokens, the prompt is cut to input_length
    (scaled by block_tokens / 512). Only the prompt is cached: the trace's later blocks do
    not say which of them hold an earlier answer."""
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= limit:
                return
            rec = json.loads(line)
            ids = np.asarray(rec["hash_ids"], dtype=np.int64)
            tokens = block_token_ids(ids, block_tokens, vocab)
            length = max(1, rec["input_length"] * block_tokens // 512)
            prompt = tokens[:length]
            yield Request(prompt, prompt)
