"""A stand-in for Model with the same forward_batch contract and no math, for scheduling
benchmarks: the engine, scheduler, tree and pools are the real ones; only the compute is
replaced by a cost model that advances a virtual clock.

Cost of one batch (seconds):
    base_s + token_s * new_tokens + kv_s * sum_i n_i * (f_full * ctx_i + (1 - f_full) * min(W, ctx_i))
where ctx_i is request i's context after the chunk and f_full the fraction of full layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .kv_pool import DualKVCache


class VirtualClock:
    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now_s += seconds

    def advance_to(self, t: float) -> None:
        self.now_s = max(self.now_s, t)


@dataclass(frozen=True)
class CostModel:
    base_s: float = 0.004      # launch + weights read per step
    token_s: float = 40e-6     # MLP/projection time per new token
    kv_s: float = 4e-9         # attention time per (new token x attended key)


class SimulatedModel:
    def __init__(self, config: ModelConfig, clock: VirtualClock, cost: CostModel = CostModel()) -> None:
        self.config, self.clock, self.cost = config, clock, cost
        self.full_fraction = len(config.full_layers) / config.layers

    def step_cost_s(self, chunks) -> float:
        c, W = self.cost, self.config.window
        total, attn = 0, 0.0
        for tokens, _, req in chunks:
            n, ctx = len(tokens), req.num_tokens + len(tokens)
            total += n
            attn += n * (self.full_fraction * ctx + (1 - self.full_fraction) * min(W, ctx))
        return c.base_s + c.token_s * total + c.kv_s * attn

    def forward_batch(self, chunks, kv: DualKVCache, all_logits: bool = False) -> list:
        if all_logits:
            raise ValueError("SimulatedModel returns last-position logits only")
        self.clock.advance(self.step_cost_s(chunks))
        out = []
        for tokens, _, req in chunks:
            end = req.num_tokens + len(tokens)
            if req.num_pages < req.pages_for(end):
                raise ValueError("request pages do not cover the chunk: grow() first")
            window = req.swa_pages[max(0, (req.num_tokens - self.config.window + 1) // req.page_size):]
            if any(p is None for p in window):
                raise ValueError("SWA KV of the window is not live")
            req.num_tokens = end
            logits = np.zeros((1, self.config.vocab_size), dtype=np.float32)
            logits[0, (int(tokens[-1]) * 31 + end) % 256] = 1.0  # deterministic, text-like ids
            out.append(logits)
        return out
