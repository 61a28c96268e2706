"""Multi-token prediction (DeepSeek-V3 / MiMo style): K small blocks that draft the next tokens.

MTP block d (d = 1..K, weights "mtp.{d-1}.*") at position i takes the hidden state of the
previous depth at i (depth 0 = the main model's last hidden state, before its final norm)
and the embedding of token x[i+d], and predicts x[i+d+1] through the shared output head:

    u = [RMSNorm_e(embed(x[i+d])) ; RMSNorm_h(h[d-1][i])] @ proj        (2H -> H)
    h[d][i] = Block_d(u) (attention over depth d's own KV, sliding window W)
    logits  = lm_head(RMSNorm_f(h[d][i]))

So depth d's KV at position i exists once x[i+d] is known: with L committed tokens and the
main model's KV computed for C of them, depth d holds committed KV for positions
< V_d = min(C, L - d). After a sampled step (C = L - 1) the drafts come from the last
position C - 1 of each depth: depth 1 needs only committed tokens, depth d > 1 also runs
d - 1 provisional positions whose input tokens are the drafts of the depths before it;
those are recomputed every step, never counted, so a rejected draft never leaves MTP KV
behind (the rollback of the MTP KV is V_d itself).

The MTP KV of one request lives in MTPState: a ring of W + K + 1 positions per depth,
enough for the window of the next query plus the provisional positions (its SWA is O(W)
like the main model's SWA layers). Positions before MTPState.first (a prefix that came
from the cache without MTP KV) are masked out: drafting then sees less context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.worker import backend
from gcache.worker.config import ModelConfig
from gcache.worker.model import mtp_tail

if TYPE_CHECKING:
    from gcache.worker.model.base import MTPModel

# Ring positions beyond W + K + 1: room for a checkpoint a few pages behind the request's
# end to still be in the ring when its tail is written down (model/mtp_tail.py).
SNAPSHOT_SLACK_PAGES = 2


class MTPState:
    """One request's MTP KV (per depth: a ring of positions) and where each depth stands."""

    def __init__(self, config: ModelConfig, depths: int, start: int, owner: object) -> None:
        self.depths = depths
        self.cap = config.window + 2 * depths + 1 + SNAPSHOT_SLACK_PAGES * config.page_size
        shape = (depths, self.cap, config.kv_heads, config.head_dim)
        self.k = np.zeros(shape, dtype=config.dtype)
        self.v = np.zeros(shape, dtype=config.dtype)
        # the main model's last hidden per committed position (a checkpoint tail needs its last K)
        self.h0 = np.zeros((self.cap, config.hidden), dtype=config.dtype)
        self.h0_valid = start  # h0 holds committed positions < h0_valid
        # exact: every MTP KV is what a from-scratch prefill computes (built from position 0,
        # or restored from a tail); a rebuilt or blind state is never written down
        self.exact = start == 0  # (an exact rebuild sets it too: MTPSpeculator._new_state)
        self.snapped: set[int] = set()  # checkpoint lengths whose tail this state wrote
        self.first = start  # positions before it have no MTP KV (prefix from the cache)
        self.valid = [start] * depths  # V_d: depth d's committed KV covers [first, V_d)
        self.h_last: list = [None] * depths  # depth d's hidden at V_d - 1 (depth d+1's input)
        self.owner = owner  # the RequestKV this state belongs to (a new admission = a new state)

    def keys(self, d: int, lo: int, hi: int):
        """Depth d's committed K and V for positions [lo, hi) (lo >= first)."""
        idx = np.arange(lo, hi) % self.cap
        return self.k[d, idx], self.v[d, idx]

    def write(self, d: int, lo: int, k, v) -> None:
        n = k.shape[0]
        if n > self.cap:  # only the last cap positions can ever be read again
            k, v, lo = k[-self.cap :], v[-self.cap :], lo + n - self.cap
        idx = np.arange(lo, lo + k.shape[0]) % self.cap
        self.k[d, idx] = k
        self.v[d, idx] = v


class MTPHead:
    """The K MTP blocks of a model with MTP weights (base.MTPModel: transformer.Model), built
    from its public layer API; numpy/cupy like it."""

    # The MTP blocks' attention is read (True) or its output zeroed (False): the diagnostic
    # seam of bench.worker.mtp_acceptance --ablate-mtp-window (a model whose drafts do not
    # change without it gains nothing from MTP KV, whatever its source).
    window_attention: bool = True

    def __init__(self, model: MTPModel, depths: int) -> None:
        c = model.config
        if not 0 < depths <= c.mtp_layers:
            raise ValueError(f"{depths} MTP layers asked; the weights have {c.mtp_layers}")
        self.model, self.config, self.depths = model, c, depths

    def new_state(self, start: int, owner: object) -> MTPState:
        return MTPState(self.config, self.depths, start, owner)

    def step(self, st: MTPState, h0, c_old: int, c_new: int, tokens, drafts_max: int, pick=None):
        """Advance every depth after the main model computed positions [c_old, c_new) (their
        hidden states h0, [c_new - c_old, H]); `tokens`: the committed tokens (c_new + 1 of
        them once sampling started, more while mid-prefill). Returns (drafts, rows): up to
        drafts_max drafts for the tokens after tokens[-1] and each one's logits row (numpy).
        pick(row) -> token chooses a draft (default argmax); no drafts mid-prefill."""
        xp = self.model.xp
        n_tok = len(tokens)
        if st.valid[0] != c_old:
            raise ValueError(f"MTP state stands at {st.valid[0]}, the main model computed from {c_old}")
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        if c_new > c_old:
            h_np = np.asarray(backend.to_numpy(h0))
            keep = min(c_new - c_old, st.cap)
            st.h0[np.arange(c_new - keep, c_new) % st.cap] = h_np[-keep:]
            st.h0_valid = c_new
        prev, prev_lo = h0, c_old  # previous depth's hidden states and their first position
        last = list(st.h_last)  # as the step found them: depth d reads depth d-1's old one
        for d in range(self.depths):
            depth = d + 1
            lo = st.valid[d]
            committed_hi = max(lo, min(c_new, n_tok - depth))
            drafting = d < drafts_max and n_tok == c_new + 1
            hi = c_new if drafting else committed_hi
            if hi <= lo:
                if drafting:
                    break
                prev, prev_lo = None, hi
                continue
            have = 0 if prev is None else prev.shape[0]
            if lo < prev_lo:  # the previous depth's hidden at lo was stored by an earlier step
                if d == 0 or last[d - 1] is None or prev_lo - lo != 1:
                    raise ValueError("MTP: the previous depth's hidden state is missing")
                parts = [last[d - 1][None, :]] + ([prev[: hi - prev_lo]] if have else [])
                inp = xp.concatenate(parts) if len(parts) > 1 else parts[0]
            else:
                inp = prev[lo - prev_lo : hi - prev_lo]
            if inp.shape[0] != hi - lo:
                raise ValueError("MTP: hidden states do not cover the positions")
            ids = [tokens[i + depth] if i + depth < n_tok else drafts[i + depth - n_tok] for i in range(lo, hi)]
            out = self._block(st, d, inp, np.asarray(ids, dtype=np.int64), lo, hi)
            if committed_hi > lo:
                st.h_last[d] = out[committed_hi - 1 - lo]
            st.valid[d] = committed_hi
            if drafting:
                row = np.asarray(backend.to_numpy(self.draft_logits(d, out[-1:])))[0]
                rows.append(row)
                drafts.append(int(np.argmax(row)) if pick is None else int(pick(row)))
            prev, prev_lo = out, lo
        return drafts, rows

    def encode_tail(self, st: MTPState, p: int) -> bytes | None:
        """st's checkpoint tail at prefix length p (model/mtp_tail.py), None if not exact."""
        return mtp_tail.encode(st, p, self.config)

    def decode_tail(self, body: bytes, p: int, owner: object) -> tuple[MTPState, Any] | None:
        """(state at p - K, hidden rows for [p - K, p)) from a tail body, None if it does not fit."""
        return mtp_tail.decode(body, self, p, owner)

    def rebuild_start(self, req_kv, p: int, swa_pages=None) -> tuple[int, bool]:
        """(lo, exact): where a rebuild of the MTP window before a cached prefix's end p
        starts, and whether it is exact. Depth d's KV at i needs depth d-1's hidden at i,
        which reads depth d-1's window [i - W + 1, i]; so every depth is a prefill's from
        p - K - W + 1 on (what later windows and a tail read) when the main model's hidden
        states are exact from p - K * W on, i.e. when the SWA KV is live W - 1 before that
        (MTPModel.prefix_hidden). Where it is not, the rebuild covers the window only."""
        w, reach = self.config.window, self.depths * self.config.window
        live = live_swa_page(req_kv, p, swa_pages) * self.config.page_size
        exact = live == 0 or live + w - 1 <= p - reach
        return max(0, p - (reach if exact else w)), exact

    def draft_logits(self, d: int, h):
        m = self.model
        return m.norm(h, f"mtp.{d}.final_norm.weight") @ m.weight("lm_head.weight")

    def _block(self, st: MTPState, d: int, prev, ids: np.ndarray, lo: int, hi: int):
        """Depth d's block over positions [lo, hi); writes their KV into the ring."""
        m, c, xp = self.model, self.config, self.model.xp
        p = f"mtp.{d}."
        e = m.norm(m.embed(ids), p + "enorm.weight")
        h = m.norm(prev, p + "hnorm.weight")
        x = xp.concatenate([e, h], axis=-1) @ m.weight(p + "proj")
        pos = np.arange(lo, hi)
        q, k, v = m.qkv(p, x, pos)
        k_np, v_np = np.asarray(backend.to_numpy(k)), np.asarray(backend.to_numpy(v))
        old_lo = max(st.first, lo - c.window + 1)
        ko, vo = st.keys(d, old_lo, lo)
        keys = xp.asarray(np.concatenate([ko, k_np]))
        vals = xp.asarray(np.concatenate([vo, v_np]))
        kpos = np.arange(old_lo, hi)
        attn = m.attend(q, keys, vals, pos, kpos, c.window)
        if not self.window_attention:
            attn = attn * 0.0
        st.write(d, lo, k_np, v_np)
        return m.finish_layer(p, x, attn)

    def reference_drafts(self, tokens, drafts_max: int) -> list[int]:
        """Dense, cache-free drafts after the whole of `tokens` (for tests): the main model's
        hidden states for every position, then each depth over every position it has."""
        toks = np.asarray(tokens, dtype=np.int64)
        st = self.new_state(0, None)
        n = toks.size
        return self.step(st, self.model.reference_hidden(toks[:-1]), 0, n - 1, list(toks), drafts_max)[0]

    def reference_state(self, tokens, upto: int) -> MTPState:
        """Dense, cache-free MTP state after the main model computed positions [0, upto) of
        `tokens` (for tests: what a from-scratch prefill of a prefix leaves)."""
        toks = np.asarray(tokens, dtype=np.int64)
        st = self.new_state(0, None)
        self.step(st, self.model.reference_hidden(toks[:upto]), 0, upto, list(toks), 0)
        return st


def live_swa_page(req_kv, hi: int, swa_pages=None) -> int:
    """The first page of the run of live SWA pages that ends at position hi's page."""
    swa = req_kv.swa_pages if swa_pages is None else swa_pages
    page = req_kv.pages_for(hi)
    while page > 0 and swa[page - 1] is not None:
        page -= 1
    return page
