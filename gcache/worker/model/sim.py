"""A stand-in for Model with the same forward_batch contract and no math, for scheduling
benchmarks: the engine, scheduler, tree and pools are the real ones; only the compute is
replaced by a cost model that advances a virtual clock.

Cost of one batch (seconds):
    base_s + token_s * new_tokens + req_s * requests
    + kv_s * sum_i n_i * (f_full * ctx_i + (1 - f_full) * min(W, ctx_i))
    + read_s * sum_i (f_full * ctx_i + (1 - f_full) * min(W + n_i, ctx_i))
where ctx_i is request i's context after its n_i-token chunk and f_full the fraction of full
layers (with swa_dense, min(W, ctx_i) becomes min(W + n_i, ctx_i): the numpy model scores a
chunk against its whole key span and masks, where a banded kernel would not).
req_s (per-sequence overhead) and read_s (gathering each sequence's keys once per step) are
0 by default; bench/worker/ttft.py fits all five to the real numpy model (--mode real).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gcache.worker.config import ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.model.base import BatchModel


class VirtualClock:
    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.now_s += seconds

    def advance_to(self, t: float) -> None:
        self.now_s = max(self.now_s, t)


@dataclass(frozen=True)
class CostModel:
    base_s: float = 0.004  # launch + weights read per step
    token_s: float = 40e-6  # MLP/projection time per new token
    kv_s: float = 4e-9  # attention time per (new token x attended key)
    req_s: float = 0.0  # per sequence in the batch (page tables, per-sequence kernels)
    read_s: float = 0.0  # per key gathered from the pages, once per sequence

    swa_dense: bool = False  # SWA scores computed for the chunk's whole key span (W + n), masked

    def features(self, chunks, full_fraction: float, window: int) -> tuple[float, ...]:
        """(1, new tokens, sequences, token x key pairs, keys read) of one batch;
        chunks: [(new_tokens, context_after)]."""
        f, W = full_fraction, window
        total = sum(n for n, _ in chunks)
        band = (lambda n: W + n) if self.swa_dense else (lambda n: W)
        attn = sum(n * (f * ctx + (1 - f) * min(band(n), ctx)) for n, ctx in chunks)
        read = sum(f * ctx + (1 - f) * min(W + n, ctx) for n, ctx in chunks)
        return (1.0, float(total), float(len(chunks)), attn, read)

    def cost_s(self, feats) -> float:
        return sum(c * x for c, x in zip((self.base_s, self.token_s, self.req_s, self.kv_s, self.read_s), feats))


class SimulatedModel(BatchModel):
    """The cost model above behind BatchModel: checks the page rules, fakes the logits."""

    def __init__(self, config: ModelConfig, clock: VirtualClock, cost: CostModel = CostModel()) -> None:
        self.config, self.clock, self.cost = config, clock, cost
        self.full_fraction = len(config.full_layers) / config.layers

    def step_cost_s(self, chunks) -> float:
        shape = [(len(tokens), req.num_tokens + len(tokens)) for tokens, _, req in chunks]
        return self.cost.cost_s(self.cost.features(shape, self.full_fraction, self.config.window))

    def forward_batch(self, chunks, kv: DualKVCache, all_logits: bool = False, layer_ready=None) -> list:
        if all_logits:
            raise ValueError("SimulatedModel returns last-position logits only")
        if layer_ready is not None:
            for layer in range(self.config.layers):
                layer_ready(layer)
        self.clock.advance(self.step_cost_s(chunks))
        out = []
        for tokens, _, req in chunks:
            end = req.num_tokens + len(tokens)
            if req.num_pages < req.pages_for(end):
                raise ValueError("request pages do not cover the chunk: grow() first")
            window = req.swa_pages[max(0, (req.num_tokens - self.config.window + 1) // req.page_size) :]
            if any(p is None for p in window):
                raise ValueError("SWA KV of the window is not live")
            req.num_tokens = end
            logits = np.zeros((1, self.config.vocab_size), dtype=np.float32)
            logits[0, (int(tokens[-1]) * 31 + end) % 256] = 1.0  # deterministic, text-like ids
            out.append(logits)
        return out
