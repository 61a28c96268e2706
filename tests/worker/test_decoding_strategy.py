"""The decoding-strategy contract (engine/decoding.py): the engine's step asks a strategy to
forward and verify, and commits what it vouches for itself: the strategy never appends
tokens, finishes requests or frees pages, and hears about every departure (forget)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import pytest

from gcache.worker.engine import decoding
from gcache.worker.engine.decoding import Committed, DecodingContext, PlainDecoding, Verdict
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import FINISH_LENGTH, FINISH_STOP, Request, RequestState, SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.model.transformer import Model
from tests.support.reference import check_against_reference
from tests.support.tiny_model import tiny_config

CFG = tiny_config(dtype="float64")


class Recording(PlainDecoding):
    """Plain decoding that records what the engine asked of it, and checks the contract's
    order: verify sees a request before its tokens are appended, after_commit after."""

    def __init__(self, ctx: DecodingContext) -> None:
        super().__init__(ctx)
        self.verified: list[tuple[int, int, int]] = []  # (rid, output length, tokens vouched)
        self.committed: list[tuple[int, Committed]] = []
        self.forgotten: list[int] = []

    def verify(self, r: Request, n: int, out) -> Verdict:
        v = super().verify(r, n, out)
        self.verified.append((r.rid, len(r.output), len(v.tokens)))
        return v

    def after_commit(self, r: Request, out, verdict: Verdict, committed: Committed) -> None:
        if len(r.output) != committed.output_before + committed.emitted or r.state is not RequestState.RUNNING:
            raise AssertionError(f"{r}: after_commit before the commit, or after the finish")
        self.committed.append((r.rid, committed))

    def forget(self, r: Request) -> None:
        self.forgotten.append(r.rid)


def engine(full_pages: int = 200, swa_pages: int = 40) -> tuple[Engine, Recording]:
    sc = SchedulerConfig(max_tokens_per_step=64, chunk_tokens=24, max_running=4)
    ec = EngineConfig(max_prompt_tokens=400, max_new_tokens=64, scheduler=sc)
    made: list[Recording] = []

    def build(ctx: DecodingContext) -> Recording:
        made.append(Recording(ctx))
        return made[0]

    e = Engine(Model(CFG), DualKVCache(CFG, full_pages, swa_pages), ec, decoding=build)
    return e, made[0]


def test_the_engine_commits_and_finishes_what_a_strategy_vouches_for():
    e, rec = engine()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 500, size=int(rng.integers(5, 60)))] for _ in range(4)]
    first = e.add_request(prompts[0], SamplingParams(max_tokens=6), record_logits=True)
    e.run_until_idle(on_step=e.check_integrity)
    stop = first.output[2]  # greedy: the same prompt stops on its third token
    reqs = [e.add_request(prompts[0], SamplingParams(max_tokens=6, stop_token_ids=(stop,)), record_logits=True)]
    reqs += [e.add_request(p, SamplingParams(max_tokens=5), record_logits=True) for p in prompts[1:]]
    e.run_until_idle(on_step=e.check_integrity)
    assert reqs[0].output == first.output[:3] and reqs[0].finish_reason == FINISH_STOP
    assert all(len(r.output) == 5 and r.finish_reason == FINISH_LENGTH for r in reqs[1:])
    for r in [first, *reqs]:
        check_against_reference(e.model, r)
        commits = [c for rid, c in rec.committed if rid == r.rid]
        assert [c.output_before for c in commits] == list(range(len(r.output)))  # one token a commit
        assert [c.finishing for c in commits] == [False] * (len(r.output) - 1) + [True]
        assert commits[0].wrote  # the write cadence: after prefill
        assert rec.forgotten.count(r.rid) == 1  # it left once: finished
        # verify runs before the commit: it sees the output before the token it vouches for
        vouching = [(out_len, n) for rid, out_len, n in rec.verified if rid == r.rid and n]
        assert vouching == [(i, 1) for i in range(len(r.output))]


def test_a_preempted_request_is_forgotten_and_resumes():
    """Tiny pools: preemptions happen; every departure reaches the strategy's forget, and the
    outputs still equal the dense reference."""
    e, rec = engine(full_pages=14, swa_pages=14)
    rng = np.random.default_rng(1)
    reqs = [
        e.add_request(
            [int(t) for t in rng.integers(3, 500, size=40)], SamplingParams(max_tokens=30), record_logits=True
        )
        for _ in range(3)
    ]
    e.run_until_idle(on_step=e.check_integrity)
    assert sum(r.preemptions for r in reqs) > 0
    for r in reqs:
        check_against_reference(e.model, r)
        assert rec.forgotten.count(r.rid) == r.preemptions + 1


def test_a_verdict_claiming_kv_the_forward_did_not_compute_is_refused():
    """The commit shrinks the KV to the committed tokens; a verdict with more tokens than
    positions computed (drafts it did not verify) cannot make it grow."""

    class Overclaiming(PlainDecoding):
        def verify(self, r: Request, n: int, out) -> Verdict:
            v = super().verify(r, n, out)
            return Verdict(v.computed, v.tokens * 3, v.rows * 3) if v.tokens else v

    e = Engine(
        Model(CFG),
        DualKVCache(CFG, 200, 40),
        EngineConfig(scheduler=SchedulerConfig(max_tokens_per_step=64, chunk_tokens=24)),
        decoding=Overclaiming,
    )
    e.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="shrink to"):
        e.run_until_idle()


def test_speculative_decoding_does_not_import_the_engine():
    """The engine <-> speculative import circle is gone: the strategies know the contract
    only (not even under TYPE_CHECKING)."""
    root = Path(decoding.__file__).parent
    for name in ("decoding.py", "speculative.py", "batcher.py"):
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "gcache.worker.engine.engine" not in imported, name
