"""The four cross-tier failure modes of the production report, one regression test each.

Every test runs its scenario twice, with the fix on and with it switched off, and asserts
both outcomes: the fix-on run gives the right answer, the fix-off run shows the failure.
So each test fails if its fix stops working, and also if the scenario stops exercising it.

  1. device-complete, host-deficient   fix: HostCache.honor_pins (pinned host pages stay)
  2. host-complete, device-deficient   fix: TieredCacheConfig.chunk_loads (load what fits)
  3. L3 evicts prefix pages of hot chains  fix: TieredCacheConfig.l3_protect_prefix
  4. SWA retention for short sequences fix: TieredCacheConfig.swa_checkpoint_ends

Real parts only: real gcache-server processes wherever L3 is involved (the node's own
S3-FIFO eviction in test 3), the tiny float64 model, every output compared token for token
with an engine without any cache (and logits with the dense reference where they must be
right), check_integrity after every step. No timing assertions; every wait is bounded.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matmuls: threads only add contention

import signal
import time

import numpy as np
import pytest

import gcache
from gcache.common.attention import AttentionKind
from gcache.wire.keys import KeyBuilder, page_hashes_array
from gcache.worker.engine.engine import Engine
from gcache.worker.engine.request import Request, SamplingParams
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.transformer import Model
from tests.support.tiered_cache_support import CFG, build_engine

PS, W = CFG.page_size, CFG.window
MODEL_NAME = "failure-modes"
LOGIT_ATOL = 1e-9
GREEDY4 = SamplingParams(max_tokens=4, temperature=0.0)
HUGE = 10**6


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CFG)


@pytest.fixture
def make_engine(model):
    """Builds engines; every one is closed at teardown (stops its L3 threads)."""
    made: list[Engine] = []

    def make(
        full_pages: int = 128,
        swa_pages: int = 32,
        cache_config: TieredCacheConfig | None = None,
        prefix_cache: bool = True,
    ) -> Engine:
        engine = build_engine(model, full_pages, swa_pages, cache_config or TieredCacheConfig(), prefix_cache)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def tiered_config(l2_full: int = 0, l2_swa: int = 0, l3: str = "", **kw) -> TieredCacheConfig:
    """A TieredCacheConfig whose host pool has exactly l2_full full and l2_swa SWA slots."""
    budget = l2_full * DualKVCache.page_bytes(CFG, AttentionKind.FULL) + l2_swa * DualKVCache.page_bytes(
        CFG, AttentionKind.SWA
    )
    ratio = l2_swa / l2_full if l2_full else 0.25
    return TieredCacheConfig(l2_bytes=budget, l2_swa_full_ratio=ratio, l3_url=l3, model_name=MODEL_NAME, **kw)


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, 256, size=n)]


def step_checked(engine: Engine, extra_check=None) -> None:
    engine.step()
    engine.check_integrity()
    if extra_check is not None:
        extra_check(engine)
    if not engine.last_step_ran:
        time.sleep(0.001)  # a request waits on its L3 prefetch (bounded by the client's timeouts)


def run(engine: Engine, prompt, params: SamplingParams = GREEDY4, extra_check=None) -> Request:
    """Submit one request and step (integrity checked after every step) until the engine is idle."""
    r = engine.add_request(prompt, params, record_logits=True)
    for _ in range(20_000):
        if not engine.has_work():
            return r
        step_checked(engine, extra_check)
    raise AssertionError(f"engine still busy: {engine.batcher.running} {engine.scheduler.waiting}")


def max_logit_error(model: Model, r: Request) -> float:
    """Largest |logit - dense float64 reference| over r's sampled positions."""
    seq = np.asarray(list(r.prompt) + r.output[:-1], dtype=np.int64)
    ref = np.asarray(model.reference_logits(seq))[len(r.prompt) - 1 :]
    assert len(r.logits) == len(r.output) == len(ref)
    return max(float(np.abs(np.asarray(got) - want).max()) for got, want in zip(r.logits, ref))


def assert_exact(model: Model, r: Request, plain: Engine) -> None:
    """r's output equals a no-cache engine's, and its logits the dense reference's."""
    assert run(plain, r.prompt, r.params).output == r.output, f"{r} differs from the no-cache run"
    assert max_logit_error(model, r) <= LOGIT_ATOL


def follow_up(r: Request, extra: list[int]) -> list[int]:
    """The next turn of r's chat: its prompt + its answer + new user tokens."""
    return list(r.prompt) + r.output + extra


# ---- 1 ------------------------------------------------------------------------------------
def test_device_complete_host_deficient(model, server_factory, make_engine):
    """Failure mode 1: L1 has a prefix, L2 only part of it.

    (a) The hit is counted from L1: the whole prefix, exactly what an engine with no L2 gets,
        although L2 alone would give nothing (its page 0 was evicted).
    (b) No host page is evicted while it is being written to L3. The L3 node is SIGSTOPped
        with a long l3_timeout_s, so the single L3 writer blocks on a first "gate" write and
        every later write job waits in its queue, its pages pinned in L2 (claim_for_l3 captured
        their slots); a workload then overflows the tiny L2 (16 full slots). After SIGCONT and
        drain, a fresh engine (cold L1 and L2, same model name, same L3) replays the first
        prompt of the workload from L3.
        Fix on (honor_pins=True): the pinned pages stayed (writes that found no unpinned slot
        were dropped instead), L3 got the right bytes, and the replay equals the no-cache run.
        Fix off (honor_pins=False): eviction reused the pinned slots, the writer sent other
        pages' KV under the first prompt's keys, and the replay, a full L3 hit, loads them:
        its logits differ from the dense reference. Both runs are asserted here.
    """
    rng = np.random.default_rng(11)
    plain = make_engine(prefix_cache=False)

    # (a) L1 has the whole prefix, L2 has it minus its first pages.
    l1_only = make_engine(cache_config=tiered_config())
    engine = make_engine(cache_config=tiered_config(l2_full=16, l2_swa=12))
    long_prompt, other = tokens(rng, 97), tokens(rng, 57)  # 12 and 7 computed pages
    extra = tokens(rng, 5)
    again = {}
    for e in (l1_only, engine):
        first = run(e, long_prompt)
        run(e, other)  # 19 pages > 16 L2 slots: long_prompt's oldest pages leave L2
        again[e] = run(e, follow_up(first, extra))
        assert_exact(model, again[e], plain)
    keys = again[engine].page_keys()[:12]
    host = engine.cache.host
    assert 0 < sum(k in host for k in keys) < len(keys)  # L2 has part of the prefix ...
    assert host.run(keys, 0)[0] == 0  # ... but not its page 0
    assert again[engine].cached_tokens == again[l1_only].cached_tokens == 12 * PS
    assert again[engine].cached_by_tier == {"l1": 12 * PS, "l2": 0, "l3": 0}

    # (b) Writes pending to a stopped L3 pin their host pages.
    workload = [tokens(rng, 57) for _ in range(8)]  # 7 computed pages each
    outcome = {}
    for honor_pins in (True, False):
        node = server_factory(f"node-pins-{honor_pins}", memory="16MiB", disk="0")
        config = tiered_config(l2_full=16, l2_swa=12, l3=node.address, prefetch_policy="best_effort", l3_timeout_s=60.0)
        writer = make_engine(cache_config=config)
        writer.cache.host.honor_pins = honor_pins
        host, l3 = writer.cache.host, writer.cache.l3
        run(writer, tokens(rng, 17))  # connections opened while the node runs
        assert l3.drain(10.0)
        node.proc.send_signal(signal.SIGSTOP)
        try:
            run(writer, tokens(rng, 17))  # the gate: its write blocks the only writer thread
            deadline = time.monotonic() + 10.0
            while l3.write_queue_depth() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert l3.write_queue_depth() == 0, "the L3 writer never took the gate job"
            first = run(writer, workload[0])
            first_keys = first.page_keys()[:7]
            entries = [host.get(k) for k in first_keys]
            assert all(e is not None and e.l3_queued and e.pins == 1 for e in entries), (
                [(e.l3_queued, e.pins) if e else None for e in entries],
                l3.stats,
                l3.available(),
            )
            for prompt in workload[1:]:
                run(writer, prompt)
            kept = sum(k in host for k in first_keys)
            stats = writer.cache.stats()
        finally:
            node.proc.send_signal(signal.SIGCONT)
        assert l3.drain(30.0)
        writer.check_integrity()
        assert host.pins() == {}

        reader = make_engine(
            cache_config=tiered_config(l2_full=64, l2_swa=32, l3=node.address, prefetch_policy="wait_complete")
        )
        replay = run(reader, workload[0])
        assert replay.cached_by_tier == {"l1": 0, "l2": 0, "l3": 7 * PS}
        outcome[honor_pins] = (kept, stats, replay)

    kept, stats, replay = outcome[True]
    assert kept == 7  # pinned pages were never evicted ...
    assert stats["l2_write_dropped"] > 0  # ... although L2 was short of slots
    assert_exact(model, replay, plain)

    kept, stats, replay = outcome[False]
    assert kept < 7 and stats["l2_write_dropped"] == 0  # evicted under their pins
    assert max_logit_error(model, replay) > 1e-6  # wrong KV came back from L3


# ---- 2 ------------------------------------------------------------------------------------
def test_host_complete_device_deficient(model, make_engine):
    """Failure mode 2: L2 has a long prefix but the device pools cannot hold it all.

    Scenario (24 device full pages): X (20 pages) is computed, so L2 holds its full pages
    with SWA at its end tail; L1 is emptied; T = X's first 6 pages is computed, so L1 holds
    them and L2 gets a window-safe checkpoint at page 6. A long decode R then holds the device
    while Q = X + 5 tokens arrives: admission evicts Q's own L1 prefix to make room, and the
    load of Q's 20 L2 pages finds room for only 18 of them (one page stays for the token to
    compute).
    Fix on (chunk_loads=True): the load is cut to the last window-safe point that fits,
    page 6 (page 18 is not window-safe): Q gets 48 tokens from L2.
    Fix off (chunk_loads=False): all-or-nothing, so Q gets nothing from L2.
    Both runs: outputs equal the no-cache run, check_integrity after every step, and no
    host page stays pinned after a step (pages are unpinned once loaded).
    """
    rng = np.random.default_rng(2)
    x, y = tokens(rng, 160), tokens(rng, 40)
    plain = make_engine(prefix_cache=False)
    got = {}
    for chunk_loads in (True, False):
        engine = make_engine(
            full_pages=24, swa_pages=24, cache_config=tiered_config(l2_full=64, l2_swa=32, chunk_loads=chunk_loads)
        )
        host = engine.cache.host
        done = [run(engine, x + [1], SamplingParams(max_tokens=1), no_pins)]
        keys = done[0].page_keys()[:20]
        assert host.run(keys, 0)[0] == 20
        assert engine.cache.evict(HUGE, HUGE) != (0, 0) and engine.cache.cached_pages() == (0, 0)
        engine.scheduler.tree_changed()
        done.append(run(engine, x[: 6 * PS + 1], SamplingParams(max_tokens=1), no_pins))
        assert done[-1].cached_tokens == 0  # L2 had no checkpoint at page 6 yet

        long_decode = engine.add_request(y, SamplingParams(max_tokens=40), record_logits=True)
        while not long_decode.output:
            step_checked(engine, no_pins)
        q = engine.add_request(x + [9] * 5, GREEDY4, record_logits=True)
        while engine.has_work():
            step_checked(engine, no_pins)
        done += [long_decode, q]
        for r in done:
            assert_exact(model, r, plain)
        got[chunk_loads] = (q.cached_by_tier, engine.cache.stats()["loads_cut_to_fit"])

    by_tier, cuts = got[True]
    assert by_tier == {"l1": 0, "l2": 6 * PS, "l3": 0} and cuts == 1  # 0 < 48 < 160: chunked
    by_tier, cuts = got[False]
    assert by_tier == {"l1": 0, "l2": 0, "l3": 0} and cuts == 1  # all-or-nothing: nothing


def no_pins(engine: Engine) -> None:
    assert engine.cache.host.pins() == {}, "a host page is still pinned after its load"


# ---- 3 ------------------------------------------------------------------------------------
def test_l3_keeps_prefix_pages_of_hot_chains(model, server_factory, make_engine):
    """Failure mode 3, measured with the node's own eviction: a gcache-server with a 1 MiB
    memory tier and no disk (--disk 0: what S3-FIFO evicts leaves the node), running
    --eviction-policy s3fifo (the default chain policy keeps a chain's page 0 by itself:
    tests/node/test_eviction_chain.py).

    A hot chat is extended every third request on a worker whose L1 keeps it (its turns
    hit L1, so nothing ever reads the chat back from L3), while 40 cold one-off chains are
    written to the same node, several times its memory. Then, at the very end (an EXISTS is
    a use for S3-FIFO, so nothing is probed before), which of the hot chat's full pages are
    still on the node, and whether a fresh worker can resume the chat from L3.
    Fix on (l3_protect_prefix=True): every write stores its pages suffix-first and probes
    its chain's prefix pages (full and SWA keys), so the hot chain's pages reach S3-FIFO's
    main queue: all of them and its end checkpoint are still there, and the fresh worker
    resumes all 20 pages from L3.
    Fix off: the hot chain is just as cold as the one-off chains to the node; FIFO order
    evicts its page 0 first while its newest pages remain, and the fresh worker gets no
    hit at all (a chain without page 0 is worthless).
    (The prefetcher's probe from page 0 is the reader side of the fix; it is not switchable
    and reads nothing of the hot chat here.) Every output equals the no-cache run.
    """
    plain = make_engine(prefix_cache=False)
    got = {}
    for protect in (True, False):
        rng = np.random.default_rng(3)
        node = server_factory(
            f"node-hot-{protect}", memory="1MiB", disk="0", extra_args=["--eviction-policy", "s3fifo"]
        )
        config = tiered_config(
            l2_full=256, l2_swa=128, l3=node.address, prefetch_policy="wait_complete", l3_protect_prefix=protect
        )
        worker = make_engine(full_pages=1024, swa_pages=64, cache_config=config)
        done = [run(worker, tokens(rng, 45))]
        hot = done[0]
        for i in range(40):
            done.append(run(worker, tokens(rng, 57)))  # a cold one-off chain
            assert worker.cache.l3.drain(10.0)  # one writer, in order: a deterministic node
            if i % 3 == 2:
                hot = run(worker, follow_up(hot, tokens(rng, 5)))
                done.append(hot)
                assert worker.cache.l3.drain(10.0)
                assert hot.cached_by_tier["l1"] == hot.cached_tokens > 0
        for r in done:
            assert run(plain, r.prompt, r.params).output == r.output
        chain = page_hashes_array(np.asarray(list(hot.prompt) + hot.output), PS)
        keys = KeyBuilder(model=MODEL_NAME)
        probe = gcache.Client(node.address)
        try:
            present = probe.batch_is_exist([keys.key(h, "full") for h in chain])
            tail_swa = probe.batch_is_exist([keys.key(h, "swa") for h in chain[-W // PS :]])
        finally:
            probe.close()
        fresh = make_engine(
            cache_config=tiered_config(l2_full=64, l2_swa=32, l3=node.address, prefetch_policy="wait_complete")
        )
        resumed = run(fresh, follow_up(hot, tokens(rng, 3)))
        assert run(plain, resumed.prompt, resumed.params).output == resumed.output
        got[protect] = (present, tail_swa, resumed.cached_by_tier)

    present, tail_swa, by_tier = got[True]
    assert len(present) == 20 and all(present) and all(tail_swa)  # full pages and the end checkpoint
    assert by_tier == {"l1": 0, "l2": 0, "l3": 20 * PS}
    present, tail_swa, by_tier = got[False]
    assert not present[0] and present[-1] and all(tail_swa)  # page 0 went first, later pages remain
    assert by_tier == {"l1": 0, "l2": 0, "l3": 0}


# ---- 4 ------------------------------------------------------------------------------------
def test_swa_retention_short_sequences(model, server_factory, make_engine):
    """Failure mode 4: a chat shorter than a few windows (48 tokens, W = 32) keeps its SWA
    checkpoint in L2 and L3, so its next turn hits after L1 eviction.

    Turn 1 runs, L1 is evicted entirely, turn 2 (turn 1 + answer + new text) runs on the
    same worker (L2) and on a fresh worker sharing the L3 node.
    Fix on (swa_checkpoint_ends=True): turn 1's end is a checkpoint in every tier, so turn 2
    hits all 48 tokens of turn 1 from L2, and from L3 on the fresh worker.
    Fix off (checkpoints only every C = 64 pages, longer than the chat): no tier below L1
    holds an SWA window for the chat, so turn 2 gets nothing from L2 or L3.
    Outputs equal the no-cache run in both.
    """
    plain = make_engine(prefix_cache=False)
    got = {}
    for ends in (True, False):
        rng = np.random.default_rng(4)
        node = server_factory(f"node-swa-{ends}", memory="16MiB", disk="0")
        kw = {} if ends else {"swa_checkpoint_ends": False, "swa_checkpoint_pages": 64}
        config = tiered_config(l2_full=64, l2_swa=32, l3=node.address, prefetch_policy="wait_complete", **kw)
        worker, fresh = make_engine(cache_config=config), make_engine(cache_config=config)
        turn1 = run(worker, tokens(rng, 41), SamplingParams(max_tokens=8))
        assert worker.cache.l3.drain(10.0)
        worker.cache.evict(HUGE, HUGE)
        worker.scheduler.tree_changed()
        assert worker.cache.cached_pages() == (0, 0)
        turn2 = follow_up(turn1, tokens(rng, 5))
        from_l2 = run(worker, turn2, SamplingParams(max_tokens=8))
        from_l3 = run(fresh, turn2, SamplingParams(max_tokens=8))
        for r in (turn1, from_l2, from_l3):
            assert_exact(model, r, plain)
        got[ends] = (from_l2.cached_by_tier, from_l3.cached_by_tier)

    turn1_len = 41 + 8 - 1  # computed tokens of turn 1: 6 whole pages
    assert got[True] == ({"l1": 0, "l2": turn1_len // PS * PS, "l3": 0}, {"l1": 0, "l2": 0, "l3": turn1_len // PS * PS})
    assert got[False] == ({"l1": 0, "l2": 0, "l3": 0}, {"l1": 0, "l2": 0, "l3": 0})
