"""The hybrid SWA decoder: GQA, RoPE, RMSNorm, SwiGLU; paged forward and a dense reference.

Full-attention layers attend to every earlier position; SWA layers to (p - W, p].
`forward` runs a chunk of one request through the paged KV cache (prefill chunk or one
decode token); `forward_batch` runs several requests' chunks with shared matmuls;
`reference_logits` is the dense, cache-free ground truth.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from gcache.common.attention import AttentionKind
from gcache.worker import backend
from gcache.worker.config import ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV
from gcache.worker.model.base import MTPModel
from gcache.worker.model.mtp import live_swa_page
from gcache.worker.model.weights import init_weights, validate


class PageReads(NamedTuple):
    """Where one chunk's keys of one pool kind live: the pages and slots its new K/V go to
    (None: a read-only pass, nothing written), the pages its attention reads, and the
    positions of the keys they hold."""

    write_pages: Any
    write_slots: Any
    read_pages: Any
    kpos: np.ndarray


class ChunkPlan(NamedTuple):
    """One request's chunk, validated, with its page indices per pool kind."""

    tokens: np.ndarray
    positions: np.ndarray
    req: RequestKV
    tables: dict[AttentionKind, PageReads]


class Model(MTPModel):
    """The real model (numpy, or cupy through the backend) behind BatchModel, with the
    public layer API its MTP blocks (model/mtp.py) build on (MTPModel)."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray] | None = None, xp=None) -> None:
        self.config = config
        self.xp = xp if xp is not None else backend.xp
        host = init_weights(config) if weights is None else validate(config, weights)
        self.w = {k: self.xp.asarray(v) for k, v in host.items()}
        half = config.head_dim // 2
        self._inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) / half))

    # ---- building blocks (MTPModel's layer API) --------------------------------------------
    def weight(self, name: str) -> Any:
        return self.w[name]

    def embed(self, ids) -> Any:
        return self.w["embed.weight"][self.xp.asarray(ids)]

    def norm(self, x, name: str):
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

    def qkv(self, layer, x, positions: np.ndarray):
        """layer: an index of the main stack, or a weight-name prefix (an MTP block's)."""
        c, p = self.config, layer if isinstance(layer, str) else f"layers.{layer}."
        h = self.norm(x, p + "attn_norm.weight")
        t = x.shape[0]
        q = (h @ self.w[p + "attn.wq"]).reshape(t, c.heads, c.head_dim)
        k = (h @ self.w[p + "attn.wk"]).reshape(t, c.kv_heads, c.head_dim)
        v = (h @ self.w[p + "attn.wv"]).reshape(t, c.kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def attend(self, q, k, v, qpos: np.ndarray, kpos: np.ndarray, window: int | None):
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

    def finish_layer(self, layer, x, attn):
        """The attention output projection and the MLP, residuals included (layer as in qkv)."""
        p = layer if isinstance(layer, str) else f"layers.{layer}."
        x = x + attn @ self.w[p + "attn.wo"]
        h = self.norm(x, p + "mlp_norm.weight")
        gate, up = h @ self.w[p + "mlp.w_gate"], h @ self.w[p + "mlp.w_up"]
        return x + (gate / (1.0 + self.xp.exp(-gate)) * up) @ self.w[p + "mlp.w_down"]

    def _logits(self, x):
        return self.norm(x, "final_norm.weight") @ self.w["lm_head.weight"]

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
        return self._logits(self.reference_hidden(tokens))

    def reference_hidden(self, tokens):
        """The last hidden states [n, hidden] (before the final norm) of every position of the
        whole sequence, no cache, plain masks."""
        c, tokens = self.config, self._check_tokens(tokens)
        pos = np.arange(tokens.size)
        x = self.embed(tokens)
        for layer, kind in enumerate(c.layer_pattern):
            q, k, v = self.qkv(layer, x, pos)
            attn = self.attend(q, k, v, pos, pos, None if kind == AttentionKind.FULL else c.window)
            x = self.finish_layer(layer, x, attn)
        return x

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

    def logits(self, hidden: Any) -> Any:
        """Logits of hidden states from forward_hidden (or an MTP block: same head)."""
        return self._logits(hidden)

    def prefix_hidden(self, tokens, req_kv: RequestKV, kv: DualKVCache, lo: int, hi: int, swa_pages=None):
        """(hidden, lo2): the last hidden states at positions [lo2, hi) of a cached prefix
        (lo2 >= lo: where the request's live SWA KV starts; (None, hi) if none is), read from
        the request's pages through the forward's own path without writing any (they may be
        the prefix tree's, shared). `tokens`: the sequence's tokens, at least hi of them.
        Full layers read every position; SWA layers only what is live (a checkpoint keeps SWA
        KV for its last W tokens), so positions less than W - 1 after the live run's start
        see a shorter window than a prefill did; later ones are a prefill's.
        swa_pages: the SWA page table to read (default req_kv's; CacheManager.prefix_swa_pages
        adds the cache's live pages before the request's window)."""
        ps, xp = self.config.page_size, self.xp
        swa = req_kv.swa_pages if swa_pages is None else swa_pages
        swa_from = live_swa_page(req_kv, hi, swa)
        lo = max(lo, swa_from * ps)
        if lo >= hi:
            return None, hi
        tables = {}
        for kind, table, first in ((AttentionKind.FULL, req_kv.full_pages, 0), (AttentionKind.SWA, swa, swa_from)):
            read = xp.asarray(np.asarray(table[first : req_kv.pages_for(hi)], dtype=np.int64))
            tables[kind] = PageReads(None, None, read, np.arange(first * ps, hi))
        plan = ChunkPlan(np.asarray(tokens[lo:hi], dtype=np.int64), np.arange(lo, hi), req_kv, tables)
        x, _ = self._layers([plan], kv, None)
        return x, lo

    def _forward_x(self, chunks, kv: DualKVCache, layer_ready=None):
        c, xp = self.config, self.xp
        if kv.xp is not xp or kv.config.layer_pattern != c.layer_pattern or kv.config.dtype != c.dtype:
            raise ValueError("the KV cache was built for another backend, layer pattern or dtype")
        plans = [self._plan(tok, pos, req, kv) for tok, pos, req in chunks]
        if len({id(p.req) for p in plans}) != len(plans):
            raise ValueError("a request appears twice in one batch")
        x, bounds = self._layers(plans, kv, layer_ready)
        for p in plans:
            p.req.num_tokens = int(p.positions[-1]) + 1
        return x, bounds

    def _layers(self, plans: list[ChunkPlan], kv: DualKVCache, layer_ready):
        """Every layer over the chunks: one matmul per weight for all of them, attention per
        chunk through its page tables (writing its new K/V first where the plan says so)."""
        c, xp = self.config, self.xp
        tokens = np.concatenate([p.tokens for p in plans])
        positions = np.concatenate([p.positions for p in plans])
        bounds = np.cumsum([0] + [p.tokens.size for p in plans])
        x = self.embed(tokens)
        for layer in range(c.layers):
            q, k, v = self.qkv(layer, x, positions)
            if layer_ready is not None:
                layer_ready(layer)
            kind, j = kv.layer_slot[layer]
            k_pool, v_pool = (kv.k_full, kv.v_full) if kind == AttentionKind.FULL else (kv.k_swa, kv.v_swa)
            outs = []
            for plan, lo, hi in zip(plans, bounds[:-1], bounds[1:]):
                write_pages, write_slots, read_pages, kpos = plan.tables[kind]
                if write_pages is not None:
                    k_pool[j, write_pages, write_slots] = k[lo:hi]
                    v_pool[j, write_pages, write_slots] = v[lo:hi]
                n = kpos.size  # slots past the chunk's end hold stale data: never read them
                keys = k_pool[j, read_pages].reshape(-1, c.kv_heads, c.head_dim)[:n]
                vals = v_pool[j, read_pages].reshape(-1, c.kv_heads, c.head_dim)[:n]
                window = None if kind == AttentionKind.FULL else c.window
                outs.append(self.attend(q[lo:hi], keys, vals, plan.positions, kpos, window))
            x = self.finish_layer(layer, x, xp.concatenate(outs) if len(outs) > 1 else outs[0])
        return x, bounds

    def _plan(self, tokens, positions, req: RequestKV, kv: DualKVCache) -> ChunkPlan:
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
            (AttentionKind.FULL, req.full_pages, 0),
            (AttentionKind.SWA, req.swa_pages, max(0, (start - c.window + 1) // ps)),
        ):
            read = table[first : req.pages_for(end)]
            if any(p is None for p in read):
                raise ValueError(f"{kind} KV of pages {first}..{req.pages_for(end) - 1} is not all live")
            read_np = np.asarray(read, dtype=np.int64)
            tables[kind] = PageReads(
                xp.asarray(read_np[pos // ps - first]),
                xp.asarray(pos % ps),
                xp.asarray(read_np),
                np.arange(first * ps, end),
            )
        return ChunkPlan(tokens, pos, req, tables)
