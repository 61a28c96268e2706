"""Request streams for bench/hicache/hierarchy.py, built on bench/common/workloads.py.

A Turn is one request as the engine sees it: the prompt, the answer the engine must
generate (the scripted model emits exactly these tokens, so the next turn's prompt really
extends what the engine cached), and the request that must finish before it is sent (the
previous turn of the same conversation, or -1).

Also: the exact oracle of an infinite single cache (the longest page-aligned prefix of
each prompt that an earlier request computed, SWA or not), the working set, and the model
each workload runs on (model_for: bench.router.policies uses it too).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common.workloads import chat_workload, trace_workload
from gcache.wire.keys import page_hashes_array
from gcache.worker.config import ModelConfig


@dataclass(frozen=True)
class Turn:
    prompt: np.ndarray  # int64 token ids
    answer: np.ndarray  # tokens the engine generates (empty: free-running for max_tokens)
    max_tokens: int
    after: int = -1  # index of the turn that must finish before this one is sent

    def computed(self) -> np.ndarray:
        """Tokens whose KV the engine has computed when this request ends (the last
        sampled token is never fed back)."""
        n = len(self.prompt) + self.max_tokens - 1
        if len(self.answer):
            return np.concatenate([self.prompt, self.answer])[:n]
        return self.prompt


def chat_turns(seed: int, conversations: int, **kw) -> list[Turn]:
    """The generated multi-turn chat, with each turn linked to its conversation's
    previous turn (found by prefix: a turn's prompt starts with the previous turn's
    prompt + answer; random tokens make that unambiguous)."""
    turns: list[Turn] = []
    cached: list[np.ndarray] = []
    for req in chat_workload(seed, conversations, **kw):
        prompt = np.asarray(req.prompt, dtype=np.int64)
        after = -1
        for j in range(len(turns) - 1, -1, -1):
            c = cached[j]
            if len(c) < len(prompt) and c[-1] == prompt[len(c) - 1] and np.array_equal(c, prompt[: len(c)]):
                after = j
                break
        answer = np.asarray(req.cached[len(prompt) :], dtype=np.int64)
        turns.append(Turn(prompt, answer, max(1, len(answer)), after))
        cached.append(np.asarray(req.cached, dtype=np.int64))
    return turns


def trace_turns(
    path: Path, limit: int, block_tokens: int, prompt_tokens_max: int, output_tokens_max: int, vocab: int = 4096
) -> list[Turn]:
    """Mooncake's conversation trace (bench.common.workloads.trace_workload: shared hash ids become
    shared token prefixes). Prompts are cut at prompt_tokens_max; each request generates
    its trace output length scaled like the prompt (block_tokens / 512), at most
    output_tokens_max tokens. Requests are independent (the trace does not link turns)."""
    outputs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            outputs.append(json.loads(line)["output_length"])
    turns = []
    for req, out in zip(trace_workload(path, limit, block_tokens, vocab), outputs):
        prompt = np.asarray(req.prompt[:prompt_tokens_max], dtype=np.int64)
        n = int(min(output_tokens_max, max(1, out * block_tokens // 512)))
        turns.append(Turn(prompt, np.zeros(0, dtype=np.int64), n))
    return turns


def long_context_turns(seed: int, conversations: int, context_tokens=(8192, 16384)) -> list[Turn]:
    """Few long conversations for the density measurement: a system prompt, then turns
    that paste a long user message (a document) and get a short answer, until the
    conversation reaches a length drawn from context_tokens."""
    rng = np.random.default_rng(seed)
    toks = lambda n: rng.integers(0, 4096, int(n)).astype(np.int64)
    turns: list[Turn] = []
    for _ in range(conversations):
        target = int(rng.integers(*context_tokens))
        history, after = toks(rng.integers(1000, 2000)), -1
        while True:
            answer = toks(rng.integers(50, 200))
            room = target - len(history) - len(answer)
            if room < 500:
                break
            user = toks(min(room, rng.integers(2000, 5000)))
            prompt = np.concatenate([history, user])
            turns.append(Turn(prompt, answer, len(answer), after))
            after = len(turns) - 1
            history = np.concatenate([prompt, answer])
    return turns


def model_for(name: str, args) -> ModelConfig:
    """chat: the default hybrid model. trace: the same with the window scaled like the
    trace's blocks (args.trace_block_tokens / 512), so a block still spans 4 windows as in the real
    trace (512-token blocks, W=128) and the SWA share of a checkpoint keeps its weight."""
    if name == "chat":
        return ModelConfig(dtype="float32")
    return ModelConfig(dtype="float32", window=max(1, 128 * args.trace_block_tokens // 512))


def oracle_hit_tokens(turns: list[Turn], page_size: int) -> tuple[list[int], int]:
    """Per turn, the longest page-aligned prefix of its prompt (leaving one token to
    compute) that some earlier turn computed: the hit of an infinite single cache that
    keeps every page and all its SWA KV. Also returns the distinct pages computed."""
    seen: set[str] = set()
    hits = []
    for t in turns:
        keys = page_hashes_array(t.prompt[: (len(t.prompt) - 1) // page_size * page_size], page_size)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits.append(n * page_size)
        c = t.computed()
        seen.update(page_hashes_array(c[: len(c) // page_size * page_size], page_size))
    return hits, len(seen)


def first_turns(turns: list[Turn], arrivals) -> tuple[list[tuple[float, int]], dict[int, list[int]]]:
    """The arrival heap of the turns that start a conversation, ((time, turn index), heapified),
    and each turn's follow-ups (sent once it has finished)."""
    heap, next_turns = [], {}
    for i, t in enumerate(turns):
        if t.after < 0:
            heap.append((float(arrivals[i]), i))
        else:
            next_turns.setdefault(t.after, []).append(i)
    heapq.heapify(heap)
    return heap, next_turns
