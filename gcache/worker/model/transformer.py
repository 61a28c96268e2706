"""The hybrid SWA decoder: GQA, RoPE, RMSNorm, SwiGLU; paged forward and a dense reference.

Full-attention layers attend to every earlier position; SWA layers to (p - W, p].
`forward` runs a chunk of one request through the paged KV cache (prefill chunk or one
decode token); `forward_batch` runs several requests' chunks with shared matmuls;
`reference_logits` is the dense, cache-free ground truth.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gcache.worker import backend
from gcache.worker.config import FULL, SWA, ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV
from gcache.worker.model.base import BatchModel
from gcache.worker.model.mtp import MTPHead
from gcache.worker.model.weights import init_weights, validate


class Model(BatchModel):
    """The real model (numpy, or cupy through the backend) behind BatchModel."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray] | None = None, xp=None) -> None:
        self.config = config
        self.xp = xp if xp is not None else backend.xp
        host = init_weights(config) if weights is None else validate(config, weights)
        self.w = {k: self.xp.asarray(v) for k, v in host.items()}
        half = config.head_dim // 2
        self._inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) / half))

    # ---- building blocks ----------------------------------------------------------
    def _rmsnorm(self, x, name: str):
        xp = self.xp
        return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + self.config.rms_eps) * self.w[name]

    def _rope(self, x, positions: np.ndarray):
        """Rotate-half RoPE on x [T, n_heads, head_dim]."""
        ang = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]
        cos = self.xp.asarray(np.cos(ang).astype(self.config.dtype))[:, None, :]
        sin = self.xp.asarray(np.sin(ang).astype(self.config.dtype))[:, None, :]
        half = self.config.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _qkv(self, layer, x, positions: np.ndarray):
        """layer: an index of the main stack, or a weight-name prefix (an MTP block's)."""
        c, p = self.config, layer if isinstance(layer, str) else f"layers.{layer}."
        h = self._rmsnorm(x, p + "attn_norm.weight")
        t = x.shape[0]
        q = (h @ self.w[p + "attn.wq"]).reshape(t, c.heads, c.head_dim)
        k = (h @ self.w[p + "attn.wk"]).reshape(t, c.kv_heads, c.head_dim)
        v = (h @ self.w[p + "attn.wv"]).reshape(t, c.kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, q, k, v, qpos: np.ndarray, kpos: np.ndarray, window: int | None):
        """q [T,H,D], k/v [S,KVH,D] -> [T, H*D]; keys masked to kpos <= qpos (and > qpos - W)."""
        xp, c = self.xp, self.config
        t, g = q.shape[0], c.heads // c.kv_heads
        allowed = kpos[None, :] <= qpos[:, None]
        if window is not None:
            allowed &= kpos[None, :] > qpos[:, None] - window
        qg = q.reshape(t, c.kv_heads, g, c.head_dim).transpose(1, 2, 0, 3)  # [KVH,g,T,D]
        scores = qg @ k.transpose(1, 2, 0)[:, None] * float(c.head_dim**-0.5)  # [KVH,g,T,S]
        scores = xp.where(xp.asarray(allowed), scores, -xp.inf)
        scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = probs @ v.transpose(1, 0, 2)[:, None]  # [KVH,g,T,D]
        return out.transpose(2, 0, 1, 3).reshape(t, c.heads * c.head_dim)

    def _finish_layer(self, layer, x, attn):
        p = layer if isinstance(layer, str) else f"layers.{layer}."
        x = x + attn @ self.w[p + "attn.wo"]
        h = self._rmsnorm(x, p + "mlp_norm.weight")
        gate, up = h @ self.w[p + "mlp.w_gate"], h @ self.w[p + "mlp.w_up"]
        return x + (gate / (1.0 + self.xp.exp(-gate)) * up) @ self.w[p + "mlp.w_down"]

    def _logits(self, x):
        return self._rmsnorm(x, "final_norm.weight") @ self.w["lm_head.weight"]

    def _check_tokens(self, tokens) -> np.ndarray:
        t = np.asarray(backend.to_numpy(tokens))
        if t.ndim != 1 or t.size == 0 or t.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a non-empty 1-D int array, got shape {t.shape} dtype {t.dtype}")
        if t.min() < 0 or t.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        return t.astype(np.int64)

    # ---- dense reference ------------------------------------------------------------
    def reference_logits(self, tokens):
        """Logits [n, vocab] for every position of the whole sequence, no cache, plain masks."""
        c, tokens = self.config, self._check_tokens(tokens)
        pos = np.arange(tokens.size)
        x = self.w["embed.weight"][self.xp.asarray(tokens)]
        for layer, kind in enumerate(c.layer_pattern):
            q, k, v = self._qkv(layer, x, pos)
            attn = self._attend(q, k, v, pos, pos, None if kind == FULL else c.window)
            x = self._finish_layer(layer, x, attn)
        return self._logits(x)

    # ---- paged forward ----------------------------------------------------------------
    def forward(self, tokens, positions, req_kv: RequestKV, kv: DualKVCache, all_logits: bool = False):
        """One request's chunk; returns logits [T, vocab] if all_logits else [1, vocab] (last)."""
        return self.forward_batch([(tokens, positions, req_kv)], kv, all_logits)[0]

    def forward_batch(self, chunks, kv: DualKVCache, all_logits: bool = False, layer_ready=None) -> list:
        """BatchModel.forward_batch: one embedding and one matmul per weight for all chunks,
        attention per request through its page tables."""
        x, bounds = self._forward_x(chunks, kv, layer_ready)
        xp = self.xp
        rows = [slice(lo, hi) if all_logits else slice(hi - 1, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        logits = self._logits(x if all_logits else x[xp.asarray(bounds[1:] - 1)])
        if all_logits:
            return [logits[r] for r in rows]
        return [logits[i : i + 1] for i in range(len(rows))]

    def forward_hidden(self, chunks, kv: DualKVCache, layer_ready=None) -> list:
        """forward_batch's work, returning each chunk's last hidden states [T, hidden] (before
        the final norm) instead of logits: what MTP blocks and speculative verification need
        (logits(h) gives the logits)."""
        x, bounds = self._forward_x(chunks, kv, layer_ready)
        return [x[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def mtp_head(self, depths: int) -> MTPHead:
        """The first `depths` MTP blocks of the weights, for speculative decoding."""
        return MTPHead(self, depths)

    def logits(self, hidden: Any) -> Any:
        """Logits of hidden states from forward_hidden (or an MTP block: same head)."""
        return self._logits(hidden)

    def _forward_x(self, chunks, kv: DualKVCache, layer_ready=None):
        c, xp = self.config, self.xp
        if kv.xp is not xp or kv.config.layer_pattern != c.layer_pattern or kv.config.dtype != c.dtype:
            raise ValueError("the KV cache was built for another backend, layer pattern or dtype")
        plans = [self._plan(tok, pos, req, kv) for tok, pos, req in chunks]
        if len({id(p[2]) for p in plans}) != len(plans):
            raise ValueError("a request appears twice in one batch")
        tokens = np.concatenate([p[0] for p in plans])
        positions = np.concatenate([p[1] for p in plans])
        bounds = np.cumsum([0] + [p[0].size for p in plans])
        x = self.w["embed.weight"][xp.asarray(tokens)]
        for layer in range(c.layers):
            q, k, v = self._qkv(layer, x, positions)
            if layer_ready is not None:
                layer_ready(layer)
            kind, j = kv.layer_slot[layer]
            k_pool, v_pool = (kv.k_full, kv.v_full) if kind == FULL else (kv.k_swa, kv.v_swa)
            outs = []
            for (_, pos, req, tables), lo, hi in zip(plans, bounds[:-1], bounds[1:]):
                write_pages, write_slots, read_pages, kpos = tables[kind]
                k_pool[j, write_pages, write_slots] = k[lo:hi]
                v_pool[j, write_pages, write_slots] = v[lo:hi]
                n = kpos.size  # slots past the chunk's end hold stale data: never read them
                keys = k_pool[j, read_pages].reshape(-1, c.kv_heads, c.head_dim)[:n]
                vals = v_pool[j, read_pages].reshape(-1, c.kv_heads, c.head_dim)[:n]
                outs.append(self._attend(q[lo:hi], keys, vals, pos, kpos, None if kind == FULL else c.window))
            x = self._finish_layer(layer, x, xp.concatenate(outs) if len(outs) > 1 else outs[0])
        for _, pos, req, _ in plans:
            req.num_tokens = int(pos[-1]) + 1
        return x, bounds

    def _plan(self, tokens, positions, req: RequestKV, kv: DualKVCache):
        """Validate one chunk (before anything is written) and precompute its page indices."""
        c, xp = self.config, self.xp
        tokens = self._check_tokens(tokens)
        start, end = req.num_tokens, req.num_tokens + tokens.size
        pos = np.arange(start, end)
        if positions is not None and not np.array_equal(np.asarray(backend.to_numpy(positions)), pos):
            raise ValueError(f"positions must be the next {tokens.size} positions {start}..{end - 1}")
        if req.page_size != c.page_size or req.window != c.window:
            raise ValueError("RequestKV page_size/window differ from the model config")
        if req.num_pages < req.pages_for(end):
            raise ValueError(f"request holds {req.num_pages} pages, needs {req.pages_for(end)}: call grow() first")
        ps = c.page_size
        tables = {}
        for kind, table, first in (
            (FULL, req.full_pages, 0),
            (SWA, req.swa_pages, max(0, (start - c.window + 1) // ps)),
        ):
            read = table[first : req.pages_for(end)]
            if any(p is None for p in read):
                raise ValueError(f"{kind} KV of pages {first}..{req.pages_for(end) - 1} is not all live")
            read_np = np.asarray(read, dtype=np.int64)
            tables[kind] = (
                xp.asarray(read_np[pos // ps - first]),
                xp.asarray(pos % ps),
                xp.asarray(read_np),
                np.arange(first * ps, end),
            )
        return tokens, pos, req, tables
