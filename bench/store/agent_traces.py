"""Agent-style block traces, generated (issue 21, finding 6): what the shared traces lack.

Each request is one prefix chain of block ids (bench/store/eviction_traces.Trace; equal
ids are equal prefixes). An agent session starts from one of a few long shared tool
prompts, then loops: every turn re-sends the whole history plus the new user/tool
blocks and the model's output from the previous turn. Shapes:

  tools      many sessions over a few long shared tool prompts, short turns
  branching  sessions fork: a turn retries from an earlier point of its history
             (tree search, regenerations), so many short branches share a trunk
  long       few sessions, long outputs (many new blocks per turn)
  loops      a tight tool loop: short outputs, many turns per session, sessions
             interleaved so a session's history is wanted again only much later

`adversarial` is a shape on which the chain policy's old tuner lost to LRU (0.988x at
1/4 memory): 8 sessions in round robin, each turn extending its whole history by 2
blocks and its output by 1 (so the batch's last value, which chain puts first in line,
is what the next turn needs), restarting after 120 blocks.
"""

from __future__ import annotations

import random

from bench.store.eviction_traces import Trace

SHAPES = ("tools", "branching", "long", "loops", "adversarial")


class _Ids:
    def __init__(self):
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def agent_trace(shape: str, seed: int, requests: int = 3000) -> Trace:
    """A `shape` trace of about `requests` requests, deterministic in `seed`."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    rng = random.Random(f"{shape}/{seed}")
    ids = _Ids()
    if shape == "adversarial":
        return _round_robin(rng, ids, requests)
    p = {
        "tools": dict(prompts=4, prompt_blocks=(40, 80), sessions=40, turn_new=(1, 4), out=(1, 3), branch=0.0),
        "branching": dict(prompts=3, prompt_blocks=(30, 60), sessions=25, turn_new=(1, 3), out=(1, 4), branch=0.35),
        "long": dict(prompts=2, prompt_blocks=(10, 30), sessions=8, turn_new=(2, 6), out=(8, 24), branch=0.05),
        "loops": dict(prompts=6, prompt_blocks=(20, 50), sessions=60, turn_new=(1, 2), out=(1, 2), branch=0.0),
    }[shape]
    prompts = [ids.take(rng.randint(*p["prompt_blocks"])) for _ in range(p["prompts"])]
    histories: list[list[list[int]]] = []  # per session: its chains so far (branch points)
    chains: list[list[int]] = []
    turns_max = 200 if shape == "long" else 40
    while len(chains) < requests:
        if len(histories) < p["sessions"] or rng.random() < 0.03:
            histories.append([list(rng.choice(prompts))])
        k = rng.randrange(len(histories))
        hist = histories[k]
        base = rng.choice(hist) if p["branch"] and rng.random() < p["branch"] else hist[-1]
        if p["branch"] and base is not hist[-1]:
            base = base[: rng.randint(len(base) // 2, len(base))]  # retry from an earlier point
        chain = base + ids.take(rng.randint(*p["turn_new"]))
        chains.append(chain)
        hist.append(chain + ids.take(rng.randint(*p["out"])))  # the model's output joins the history
        if len(hist) > turns_max:
            histories.pop(k)
    return Trace(f"agent-{shape}-{seed}", chains)


def _round_robin(rng: random.Random, ids: _Ids, requests: int, sessions: int = 8) -> Trace:
    del rng  # fully determined by its shape
    history = [ids.take(8) for _ in range(sessions)]
    chains = []
    while len(chains) < requests:
        k = len(chains) % sessions
        chain = history[k] + ids.take(2)
        chains.append(chain)
        history[k] = chain + ids.take(1) if len(chain) < 120 else ids.take(8)
    return Trace("agent-adversarial", chains)
