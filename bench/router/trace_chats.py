"""The multi-turn conversations of a Mooncake-format trace (conversation_trace.jsonl) as text
prompts for real engines (bench/router/vllm_trace.py).

A record whose hash ids start with an earlier record's complete blocks (at least 2: block 0 is a
prompt every record shares) is that conversation's next turn, as bench/router/workloads.py
reads it. Only conversations of at least `min_turns` turns are kept, in the order they start,
from record `offset` on, until `requests` turns are taken (the last one may be cut short).

Each 512-token block id becomes `words` words drawn (seeded by the id) from the tiny chat
model's training text (gcache.testing.vllm_chat.CORPUS: each word is 1-4 tokens
of its BPE), starting with a space and ending with a full stop, so a block tokenizes the same
wherever it stands and equal block ids give equal token prefixes. A prompt is its record's
first `max_blocks` blocks.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from bench.router.workloads import extended_turn
from gcache.testing.vllm_chat import CORPUS

WORDS = tuple(sorted(set(re.findall(r"[a-z]+", CORPUS.lower()))))


@dataclass(frozen=True)
class ChatTurn:
    blocks: tuple[int, ...]  # the trace's hash ids (cut at max_blocks)
    output_tokens: int  # the trace's output length (unscaled)


@dataclass(frozen=True)
class Conversation:
    first_record: int
    turns: tuple[ChatTurn, ...]


def block_text(block_id: int, words: int) -> str:
    rng = random.Random(block_id)
    return " " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def prompt_text(turn: ChatTurn, words: int) -> str:
    return "".join(block_text(b, words) for b in turn.blocks)


def conversations(
    path: Path, requests: int, offset: int = 0, min_turns: int = 2, max_blocks: int = 48
) -> list[Conversation]:
    """The first conversations of >= min_turns turns starting at or after record `offset`,
    `requests` turns in all."""
    last_of: dict[tuple[int, ...], int] = {}  # complete-block chain -> latest record that sent it
    conv_of: list[int] = []  # record -> the conversation's first record
    turns_of: dict[int, list[ChatTurn]] = {}
    with open(path) as f:
        for i, line in enumerate(f):
            rec = json.loads(line)
            ids = tuple(int(x) for x in rec["hash_ids"])
            after = extended_turn(last_of, ids)
            root = conv_of[after] if after >= 0 else i
            conv_of.append(root)
            if root >= offset:
                turns_of.setdefault(root, []).append(ChatTurn(ids[:max_blocks], int(rec["output_length"])))
            complete = int(rec["input_length"]) // 512
            if complete >= 2:
                last_of[ids[:complete]] = i
    out: list[Conversation] = []
    taken = 0
    for root in sorted(turns_of):
        ts = turns_of[root]
        if len(ts) < min_turns:
            continue
        ts = ts[: requests - taken]
        out.append(Conversation(root, tuple(ts)))
        taken += len(ts)
        if taken >= requests:
            break
    return out


def working_set_blocks(convs: list[Conversation]) -> int:
    return len({b for c in convs for t in c.turns for b in t.blocks})
