"""The invariant that matters: output with prefix caching == output without it.

Every request of every workload is checked token for token against a from-scratch run
with no prefix cache, and its logits against the dense float64 reference model. The pools
are tiny so that eviction, SWA tombstones, revival and preemption all happen; the engine's
check_integrity (pools + tree + page ownership) runs after every step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matmuls: threads only add contention

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import Request, SamplingParams
from gcache.worker.engine.scheduler import QueueFullError, SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.model.transformer import Model
from tests.support.engine_support import tree_nodes
from tests.support.reference import check_against_reference
from tests.support.tiny_model import tiny_config

CFG = tiny_config(dtype="float64")
VOCAB = CFG.vocab_size


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CFG)


class Spy:
    """Counts what the tree went through: evictions, tombstones seen, tombstones revived."""

    def __init__(self, engine: Engine) -> None:
        self.evictions = self.tombstones = self.revivals = 0
        tree = engine.tree
        evict, insert = tree.evict, tree.insert

        def counting_evict(full, swa):
            got = evict(full, swa)
            self.evictions += got != (0, 0)
            return got

        def counting_insert(tokens, full_pages, swa_pages, keys=None, spare=()):
            before = self._tombstoned_full_pages(tree)
            added = insert(tokens, full_pages, swa_pages, keys=keys, spare=spare)
            present = {f for n in tree_nodes(tree) for f in n.full}
            # A tombstone's full page stays put on insert, so live SWA there now = revived.
            self.revivals += len((before & present) - self._tombstoned_full_pages(tree))
            return added

        tree.evict, tree.insert = counting_evict, counting_insert
        self.tree = tree

    def _tombstoned_full_pages(self, tree) -> set[int]:
        return {f for n in tree_nodes(tree) for f, s in zip(n.full, n.swa) if s is None}

    def after_step(self) -> None:
        self.tombstones = max(self.tombstones, len(self._tombstoned_full_pages(self.tree)))


def make_engine(
    model, full_pages: int, swa_pages: int, prefix_cache: bool, policy: str = "ttft", max_running: int = 4
) -> Engine:
    sc = SchedulerConfig(
        policy=policy, max_tokens_per_step=64, chunk_tokens=24, max_running=max_running, dedup_min_tokens=16
    )
    ec = EngineConfig(max_prompt_tokens=400, max_new_tokens=64, prefix_cache=prefix_cache, scheduler=sc)
    return Engine(model, DualKVCache(CFG, full_pages, swa_pages), ec)


def run(engine: Engine, script, spy: Spy | None = None) -> list[Request]:
    """script: list of ("submit", prompt | callable(done) -> prompt, params), ("step", n) or
    ("evict_swa", pages).
    Callables build multi-turn prompts from finished requests."""
    reqs: list[Request] = []

    def on_step():
        engine.check_integrity()
        if spy:
            spy.after_step()

    for op in script:
        if op[0] == "evict_swa":  # outside SWA pressure: tombstones in cached branches
            engine.tree.evict(0, op[1])
            engine.scheduler.tree_changed()
            on_step()
        elif op[0] == "submit":
            prompt = op[1](reqs) if callable(op[1]) else op[1]
            reqs.append(engine.add_request(prompt, op[2], record_logits=True))
        else:
            for _ in range(op[1]):
                if engine.has_work():
                    engine.step()
                    on_step()
    engine.run_until_idle(on_step=on_step)
    return reqs


def follow_up(i: int, extra: list[int], history_max: int = 10_000):
    """Next turn of conversation i: its prompt + its answer (at most history_max tokens of
    them) + new user tokens."""
    return lambda reqs: (list(reqs[i].prompt) + reqs[i].output)[:history_max] + extra


def chat_script(seed: int) -> list:
    rng = np.random.default_rng(seed)
    toks = lambda n: [int(t) for t in rng.integers(0, 256, size=n)]
    system = toks(50)  # longer than W = 32: reuse needs a live window, not just the root path
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    script = []
    for conv in range(6):
        script.append(("submit", system + toks(int(rng.integers(3, 30))), greedy))
    script.append(("step", 3))
    script.append(("submit", toks(90), SamplingParams(max_tokens=30, temperature=0.8, seed=7)))
    script.append(("step", 200))  # every first turn is done
    for turn in range(2):
        for conv in range(6):
            src = conv if turn == 0 else 7 + conv
            params = SamplingParams(
                max_tokens=int(rng.integers(4, 24)), temperature=[0.0, 0.9][conv % 2], seed=100 + conv
            )
            script.append(("submit", follow_up(src, toks(int(rng.integers(2, 12)))), params))
        script.append(("step", 400))
    script.append(("submit", system + toks(9), greedy))  # the system prompt again, after pressure
    return script


@pytest.mark.parametrize("policy", ["ttft", "fcfs"])
def test_chat_workload_with_cache_equals_without_cache(model, policy):
    cached = make_engine(model, full_pages=64, swa_pages=24, prefix_cache=True, policy=policy)
    spy = Spy(cached)
    with_cache = run(cached, chat_script(1), spy)
    plain = make_engine(model, full_pages=64, swa_pages=24, prefix_cache=False, policy=policy)
    without = run(plain, chat_script(1))
    assert len(with_cache) == len(without) == 20
    for a, b in zip(with_cache, without):
        assert list(a.prompt) == list(b.prompt)
        assert a.output == b.output, f"{a} differs from the no-cache run"
        check_against_reference(model, a)
    assert sum(r.cached_tokens for r in with_cache[7:]) > 0  # later turns hit their history
    assert sum(r.cached_tokens for r in without) == 0
    computed = lambda e: e.metrics.snapshot()["prefill_tokens_computed_total"]
    assert computed(cached) < computed(plain)
    assert spy.evictions > 0 and spy.tombstones > 0


@pytest.mark.slow
def test_pressure_forces_preemption_and_revival_without_changing_outputs(model):
    script = chat_script(5)
    engine = make_engine(model, full_pages=34, swa_pages=12, prefix_cache=True, max_running=6)
    spy = Spy(engine)
    got = run(engine, script, spy)
    ref = run(make_engine(model, full_pages=34, swa_pages=12, prefix_cache=False, max_running=6), script)
    for a, b in zip(got, ref):
        assert a.output == b.output
        check_against_reference(model, a)
    assert engine.metrics.snapshot()["preemptions_total"] > 0
    assert spy.evictions > 0 and spy.tombstones > 0


def test_prefix_whose_window_was_evicted_is_recomputed_and_matchable_again(model):
    """The tree keeps SWA only at checkpoints (here: the request ends), so an SWA deficit
    takes the window tails of the cached ends; the prefix is then not window-safe (no hit),
    and the request that recomputes it puts its window back (a hit for the next one)."""
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, 256, size=80)]  # 10 pages, W = 4 pages
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    script = [("submit", shared + [1, 2, 3], greedy), ("step", 50), ("submit", shared + [4, 5, 6, 7], greedy)]
    engine = make_engine(model, 64, 24, prefix_cache=True)
    spy = Spy(engine)
    first = run(engine, script, spy)
    assert first[1].cached_tokens == 80
    _, swa_held = engine.tree.cached_pages()
    # two ends' window tails (+ a page of margin) as checkpoints; the rest only as spare
    # pages (the first-reuse fix), which eviction frees first
    assert 0 < swa_held - engine.tree.spare_pages() <= 2 * 5
    assert engine.tree.evict(0, swa_held)[1] == swa_held
    again = run(engine, [("submit", shared + [9, 9], greedy)], spy)[0]
    assert again.cached_tokens == 0  # the window before page 10 is gone: not window-safe
    hit = run(engine, [("submit", shared + [8, 8, 8], greedy)], spy)[0]
    assert hit.cached_tokens == 80  # ... so the shared prefix is matchable again
    plain = run(
        make_engine(model, 64, 24, prefix_cache=False),
        script + [("submit", shared + [9, 9], greedy), ("submit", shared + [8, 8, 8], greedy)],
    )
    for a, b in zip(first + [again, hit], plain):
        assert a.output == b.output
        check_against_reference(model, a)


@st.composite
def workloads(draw):
    n_prefixes = draw(st.integers(1, 3))
    prefixes = [draw(st.lists(st.integers(0, 255), min_size=1, max_size=90)) for _ in range(n_prefixes)]
    script, n_req = [], 0
    for _ in range(draw(st.integers(3, 16))):
        kind = draw(st.sampled_from(["new", "new", "turn", "step", "evict_swa"]))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 30)),
            temperature=draw(st.sampled_from([0.0, 0.0, 0.7])),
            seed=draw(st.integers(0, 1000)),
        )
        suffix = draw(st.lists(st.integers(0, 255), min_size=0, max_size=40))
        if kind == "step":
            script.append(("step", draw(st.integers(1, 20))))
        elif kind == "evict_swa":
            script.append(("evict_swa", draw(st.integers(1, 8))))
        elif kind == "turn" and n_req:
            script.append(("submit", follow_up(draw(st.integers(0, n_req - 1)), suffix, 150), params))
            n_req += 1
        else:
            prompt = prefixes[draw(st.integers(0, n_prefixes - 1))] + suffix
            script.append(("submit", prompt, params))
            n_req += 1
    return script


@pytest.mark.slow
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    script=workloads(),
    full_pages=st.integers(28, 64),
    swa_pages=st.integers(12, 16),
    policy=st.sampled_from(["ttft", "fcfs"]),
)
def test_random_workloads_on_tiny_pools(model, script, full_pages, swa_pages, policy):
    """A turn waits for its source to finish (the step ops interleave the rest), so the
    prompt is known; integrity is checked after every step inside run()."""

    def settle_turns(engine):
        out = []
        for op in script:
            if op[0] == "submit" and callable(op[1]):
                out.append(("step", 10_000))
            out.append(op)
        return out

    engine = make_engine(model, full_pages, swa_pages, prefix_cache=True, policy=policy)
    spy = Spy(engine)
    got = run(engine, settle_turns(engine), spy)
    for r in got:
        check_against_reference(model, r)
    for name, seen in (
        ("evicted", spy.evictions),
        ("tombstoned", spy.tombstones),
        ("revived", spy.revivals),
        ("preempted", engine.metrics.snapshot()["preemptions_total"]),
        ("hit", sum(r.cached_tokens for r in got)),
    ):
        if seen:
            event(name)  # --hypothesis-show-statistics shows how often each case came up
    assert engine.kv.full.num_used == engine.tree.cached_pages()[0]  # idle: only the tree holds pages


def test_bad_input_is_rejected_and_changes_nothing(model):
    engine = make_engine(model, 40, 14, prefix_cache=True)
    good = SamplingParams(max_tokens=4)
    for prompt, msg in [
        ([], "non-empty"),
        ([1, VOCAB], "token ids must be in"),
        ([-1], "token ids must be in"),
        ([1] * 401, "limit is 400"),
        ([[1, 2]], "non-empty list"),
        ([1] * 330, "KV pages"),
    ]:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(prompt, good)
    with pytest.raises(ValueError, match="max_tokens 65 exceeds"):
        engine.add_request([1, 2], SamplingParams(max_tokens=65))
    with pytest.raises(ValueError, match="max_tokens must be"):
        SamplingParams(max_tokens=0)
    assert not engine.has_work()
    assert engine.metrics.snapshot()["requests_rejected_total"] == 7
    engine.check_integrity()


def test_waiting_queue_bound_is_enforced(model):
    sc = SchedulerConfig(max_waiting=2, max_tokens_per_step=64, chunk_tokens=24, max_running=4)
    engine = Engine(model, DualKVCache(CFG, 40, 14), EngineConfig(scheduler=sc))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    engine.add_request([1, 2, 4], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request([1, 2, 5], SamplingParams(max_tokens=2))
    engine.run_until_idle(on_step=engine.check_integrity)


def test_integrity_check_catches_a_leaked_page(model):
    engine = make_engine(model, 40, 14, prefix_cache=True)
    run(engine, [("submit", list(range(40)), SamplingParams(max_tokens=3))])
    engine.kv.full.alloc(1)  # a page nobody owns
    with pytest.raises(AssertionError):
        engine.check_integrity()


def test_swa_pool_too_small_for_one_window_is_refused(model):
    with pytest.raises(ValueError, match="SWA pool has 6 pages"):
        make_engine(model, 40, 6, prefix_cache=True)
