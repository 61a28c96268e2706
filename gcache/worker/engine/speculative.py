"""Speculative decoding with the model's MTP blocks (model/mtp.py), inside the engine's step.

Per decoding request and step: the K drafts the MTP blocks proposed last step ride along
with the request's last token, so the main model verifies them in the same forward
(K + 1 positions). Greedy: keep the longest prefix of drafts that equal the main model's
argmax, then the main model's own next token; the output is the one without MTP, token for
token. temperature > 0: standard speculative rejection sampling (accept draft d with
probability min(1, p(d) / q(d)), else draw from norm(max(p - q, 0)); all accepted: draw
the bonus from p), so each token is distributed exactly as the main model's.

A strategy behind decoding.DecodingStrategy: verify returns the tokens to emit; the
engine's commit appends them (a stop token or max_tokens cuts the run; stop strings are cut
from the text by the engine thread, which may see several new tokens per step) and drops
the KV of rejected positions in every pool (RequestKV.shrink: the page tables shrink back
to the accepted length). The MTP depths never count provisional positions (MTPState.valid),
so they need no rollback; after the commit the MTP blocks run over the accepted positions
and draft the next K tokens (after_commit).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.worker import backend
from gcache.worker.engine.decoding import Committed, DecodingContext, DecodingStrategy, LayerReady, Verdict
from gcache.worker.engine.request import Request
from gcache.worker.model.base import MTPModel
from gcache.worker.model.mtp import MTPHead

if TYPE_CHECKING:
    from gcache.worker.kvcache.kv_pool import DualKVCache
    from gcache.worker.kvcache.tiers.mtp_tails import MTPTails
    from gcache.worker.model.mtp import MTPState


class MTPPrefix(enum.StrEnum):
    """Where a request's MTP KV comes from (EngineConfig.mtp_prefix; the bench's configs)."""

    NONE = "none"  # not built at prefill: the MTP blocks start at the first sampled token
    PREFILL = "prefill"  # built for every token the request computes; none for a cached prefix
    REBUILD = "rebuild"  # PREFILL, and for a cached prefix (any tier) the window before it is
    #                      rebuilt at admission from the prefix's KV (a read-only forward of W tokens)
    TIERS = "tiers"  # PREFILL, checkpoint tails written to the cache's mtp pool (L1/L2/L3) and
    #                  restored exactly on a hit; REBUILD where the tail is missing or bad
    # (The peers' baselines, whose MTP blocks read stale slots, are benchmark strategies:
    # bench/worker/stale_mtp.py.)


MTP_PREFIX = tuple(m.value for m in MTPPrefix)

OUT_BUCKETS = ((0, 128, "0_128"), (128, 256, "128_256"), (256, 512, "256_512"), (512, 1 << 62, "512_inf"))


def out_bucket(position: int) -> str:
    return next(name for lo, hi, name in OUT_BUCKETS if lo <= position < hi)


def softmax(row: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(row, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    out: np.ndarray = p / p.sum()
    return out


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), p.size - 1))


def accept_greedy(rows: list[np.ndarray], drafts: list[int]) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted): the agreeing prefix, then the main model's token."""
    j = 0
    while j < len(drafts) and drafts[j] == int(np.argmax(rows[j])):
        j += 1
    return drafts[:j] + [int(np.argmax(rows[j]))], j


def accept_sampled(
    rows: list[np.ndarray], drafts: list[int], q_rows: list[np.ndarray], temperature: float, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Speculative rejection sampling: the emitted tokens are distributed as the target's."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p, q = softmax(rows[j], temperature), softmax(q_rows[j], temperature)
        if rng.random() * q[d] < p[d]:  # accept with probability min(1, p(d) / q(d))
            out.append(d)
            continue
        resid = np.maximum(p - q, 0.0)
        out.append(draw(resid if resid.sum() > 0 else p, rng))
        return out, j
    out.append(draw(softmax(rows[len(drafts)], temperature), rng))
    return out, len(drafts)


class MTPSpeculator(DecodingStrategy):
    """Speculative decoding with the model's MTP blocks (the engine's strategy when
    EngineConfig.mtp_layers > 0)."""

    def __init__(self, ctx: DecodingContext, depths: int, prefix: str = MTPPrefix.TIERS) -> None:
        if not isinstance(ctx.model, MTPModel):
            raise ValueError("MTP needs the real model (transformer.Model with MTP weights)")
        if prefix not in MTP_PREFIX:
            raise ValueError(f"mtp_prefix must be one of {MTP_PREFIX}, got {prefix!r}")
        self.model: MTPModel = ctx.model  # the MTP contract (model/base.py)
        self.kv, self.cache, self.metrics = ctx.kv, ctx.cache, ctx.metrics
        self.page_size = ctx.kv.page_size
        self.depths, self.prefix = depths, MTPPrefix(prefix)
        self.head = MTPHead(self.model, depths)

    # ---- before the forward ----------------------------------------------------------
    def decode_tokens(self, r: Request) -> int:
        """Positions a decoding request runs this step: its last token and its drafts."""
        return 1 + len(r.draft)

    def drop_drafts(self, r: Request) -> None:
        r.draft, r.draft_rows = [], []

    @staticmethod
    def chunk(r: Request, n: int) -> np.ndarray:
        """The chunk's tokens: committed ones, then the drafts (positions past num_tokens)."""
        real = min(n, r.num_tokens - r.num_computed)
        toks = r.token_slice(r.num_computed, r.num_computed + real)
        if real == n:
            return toks
        return np.concatenate([toks, np.asarray(r.draft[: n - real], dtype=np.int64)])

    def forward(self, batch: list[tuple[Request, int]], kv: DualKVCache, layer_ready: LayerReady | None) -> list[Any]:
        """The drafts ride along (verify); the hidden states feed the MTP blocks."""
        work = [(self.chunk(r, n), None, r.held_kv) for r, n in batch]
        return self.model.forward_hidden(work, kv, layer_ready=layer_ready)

    # ---- after the forward -----------------------------------------------------------
    def verify(self, r: Request, n: int, hidden: Any) -> Verdict:
        """Accept the agreeing drafts (greedy) or rejection-sample them (temperature > 0);
        mid-prefill, the MTP blocks follow the main model and nothing is emitted."""
        c_fwd = r.num_computed
        c_old = c_fwd - n
        k = n - min(n, r.num_tokens - c_old)  # drafts this chunk carried
        drafts = list(r.draft[:k])
        st = r.mtp
        if st is not None and st.owner is not r.kv:
            st = r.mtp = None  # admitted anew (preemption): its MTP KV went with its pages
        if st is None and self.builds_at_prefill():
            st = r.mtp = self._new_state(r, c_old)
        if st is not None and not r.output:  # prefill: tails at the periodic checkpoints it crosses
            self._through_checkpoints(r, st, hidden, c_old, c_fwd)
        if c_fwd < r.num_tokens:  # mid-prefill: the MTP blocks follow, nothing to sample
            if st is not None:
                base = st.valid[0]
                self.head.step(st, hidden[base - c_old :], base, c_fwd, r.tokens(), 0)
            return Verdict(computed=n - k)
        rows = list(np.asarray(backend.to_numpy(self.model.logits(hidden[n - k - 1 :])), dtype=np.float64))
        t = float(r.params.temperature)
        if t == 0.0:
            toks, accepted = accept_greedy(rows, drafts)
        else:
            toks, accepted = accept_sampled(rows, drafts, r.draft_rows[:k], t, r.rng)
        r.draft, r.draft_rows = [], []
        return Verdict(computed=n - k, tokens=toks, rows=rows, drafted=k, accepted=accepted)

    def after_commit(self, r: Request, hidden: Any, verdict: Verdict, committed: Committed) -> None:
        """Count the step, then draft the next K tokens (or, at the end, write the end's tail)."""
        m, c_new = committed.emitted, r.num_computed
        c_old = c_new - (verdict.computed + m - 1)  # where the forward started
        if committed.output_before:  # a decode forward (not the prefill's first token)
            b = out_bucket(committed.output_before)
            for name, v in (
                ("drafted", verdict.drafted),
                ("accepted", verdict.accepted),
                ("forwards", 1),
                ("emitted", m),
            ):
                self.metrics.inc(f"spec_{name}_out_{b}_total", v)
        st = r.mtp
        if committed.finishing:
            if st is not None and self._tails() is not None and st.exact:
                # the end is a checkpoint: catch the MTP depths up, write its tail down
                base = st.valid[0]
                self.head.step(st, hidden[base - c_old : c_new - c_old], base, c_new, r.tokens(), 0)
                self._snapshot(r, st)
            return
        want = min(self.depths, r.params.max_tokens - len(r.output) - 1)
        t = float(r.params.temperature)
        pick = None if t == 0.0 else (lambda row: draw(softmax(row, t), r.rng))
        if st is None:  # NONE: the MTP KV starts at the last computed position
            st = r.mtp = self.blank_state(r, c_new - 1)
        base = st.valid[0]
        r.draft, r.draft_rows = self.head.step(
            st, hidden[base - c_old : c_new - c_old], base, c_new, r.tokens(), want, pick
        )
        if committed.wrote:
            self._snapshot(r, st)

    def forget(self, r: Request) -> None:
        """r leaves the running list: its MTP KV and drafts go with its pages."""
        r.mtp, r.draft, r.draft_rows = None, [], []

    # ---- where a request's MTP KV comes from (subclasses: the benches' baselines) -------------
    def builds_at_prefill(self) -> bool:
        """Whether a request's MTP KV is built from its first computed position (all but NONE)."""
        return self.prefix is not MTPPrefix.NONE

    def blank_state(self, r: Request, start: int) -> MTPState:
        """A state from `start` on with no MTP KV before it (masked): NONE's at the first
        sampled token, PREFILL's after a cached prefix."""
        return self.head.new_state(start, r.kv)

    def _new_state(self, r: Request, c_old: int) -> MTPState:
        """A request's MTP KV from position c_old on; with a cached prefix: TIERS restores its
        checkpoint tail from the mtp pool, else (or where the tail is missing) REBUILD
        rebuilds the window before c_old from the prefix's KV (the loads brought it by now)."""
        if c_old == 0:
            return self.head.new_state(c_old, r.kv)
        if self.prefix is MTPPrefix.PREFILL:
            return self.blank_state(r, c_old)
        if self.prefix is MTPPrefix.TIERS:
            st = self._restore(r, c_old)
            if st is not None:
                return st
        # Where the prefix's SWA KV is live far enough back (a spare point in L1: the first
        # reuse) the rebuild starts early enough to be exact, and its tail is written down (the
        # resume point is a checkpoint: the branch point). Else it rebuilds the window only.
        swa = self.cache.prefix_swa_pages(r)
        lo, exact = self.head.rebuild_start(r.held_kv, c_old, swa)
        h, lo = self.model.prefix_hidden(r.tokens(), r.held_kv, self.kv, lo, c_old, swa)
        st = self.head.new_state(lo, r.kv)
        if h is not None:
            self.head.step(st, h, lo, c_old, r.tokens(), 0)
            self.metrics.inc("mtp_rebuilt_tokens_total", c_old - lo)
        st.exact = exact
        if exact:
            self._snapshot_at(r, st, c_old // self.page_size)
        return st

    def _through_checkpoints(self, r: Request, st: MTPState, hidden: Any, c_old: int, c_new: int) -> None:
        """Step the MTP depths to each periodic checkpoint in (c_old, c_new) and write its tail
        there (after a long chunk the ring no longer holds its window). Only where every depth
        reaches the checkpoint (its next K tokens are known): a tail never waits for tokens."""
        rule = self.cache.checkpoint_rule
        if self._tails() is None or not st.exact or rule is None:
            return
        ps, n_tok = self.page_size, r.num_tokens
        for npages in rule.periodic(c_old // ps, c_new // ps):
            p = npages * ps
            base = st.valid[0]
            if not base < p <= c_new or p + self.depths >= n_tok:
                continue
            self.head.step(st, hidden[base - c_old : p - c_old], base, p, r.tokens(), 0)
            self._snapshot_at(r, st, npages)

    # ---- the mtp pool (kvcache/tiers/mtp_tails.py; the tail format: MTPHead.encode_tail) -----------
    def _tails(self) -> MTPTails | None:
        return self.cache.mtp if self.prefix is MTPPrefix.TIERS else None

    def _restore(self, r: Request, p: int) -> MTPState | None:
        """The state at p from the tail of the checkpoint at p, None where there is none."""
        tails, ps = self._tails(), self.page_size
        if tails is None or p % ps or p <= self.depths:
            return None
        got = tails.get(r.page_keys(p // ps)[-1])
        dec = self.head.decode_tail(got[0], p, r.kv) if got is not None else None
        if got is None or dec is None:
            self.metrics.inc("mtp_tail_misses_total")
            return None
        st, h0 = dec
        lo = p - self.depths  # the K positions a tail leaves to the request (they need x[p], ...)
        self.head.step(st, self.model.xp.asarray(h0), lo, p, r.tokens(), 0)
        self.metrics.inc(f"mtp_tail_hits_{got[1].value}_total")
        return st

    def _snapshot(self, r: Request, st: MTPState) -> None:
        """Write the tails of r's end checkpoints (CheckpointRule.end_points: its whole pages,
        and where a resend of the same tokens resumes) to the mtp pool."""
        tails, rule = self._tails(), self.cache.checkpoint_rule
        if tails is None or not st.exact or rule is None:
            return
        for npages in set(rule.end_points(r.num_computed)):
            self._snapshot_at(r, st, npages)

    def _snapshot_at(self, r: Request, st: MTPState, npages: int) -> None:
        """Write the tail of r's checkpoint after npages whole pages (once per state)."""
        tails, p = self._tails(), npages * self.page_size
        if tails is None or not st.exact or p in st.snapped or npages < 1:
            return
        body = self.head.encode_tail(st, p)
        if body is None:
            return
        tails.put(r.page_keys(npages)[-1], body)
        st.snapped.add(p)
        self.metrics.inc("mtp_tail_writes_total")
