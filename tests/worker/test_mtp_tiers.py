"""MTP KV through every tier (issue 19): the `mtp` pool keeps checkpoint tails of the MTP
window in L1, L2 and L3 (a real gcache-server), and a prefix served from any of them brings
its tail: greedy output with MTP equals output without it, and the restored MTP state is
exactly (float64) what a from-scratch prefill of the prefix builds. A missing or corrupt
tail falls back to the rebuild, never to wrong state."""

from __future__ import annotations

import copy
import os
import threading

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import pytest

import gcache
from gcache.wire.keys import KeyBuilder
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.kvcache.tiers.host_cache import HostCache
from gcache.worker.kvcache.tiers.host_pool import HostKVPool
from gcache.worker.kvcache.tiers.l3_store import L3Config, L3Store
from gcache.worker.kvcache.tiers.mtp_tails import POOL_MTP, MTPTails, seal
from gcache.worker.model import mtp_tail
from gcache.worker.model.mtp import MTPHead
from gcache.worker.model.transformer import Model
from tests.support.tiny_model import ONE_FULL_LAYER, tiny_config

CFG = tiny_config(dtype="float64", layer_pattern=ONE_FULL_LAYER, mtp_layers=3)
PS, W, K = CFG.page_size, CFG.window, 3
MODEL_NAME = "mtp-tiers-m"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
LONG = SamplingParams(max_tokens=12, temperature=0.0)
SHARED = [int(t) for t in np.random.default_rng(3).integers(0, 256, size=200)]
PAGES = 18  # the checkpoint a second request resumes at


def upto(pages: int, extra=()) -> list[int]:
    return SHARED[: pages * PS] + [SHARED[pages * PS], *extra]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CFG)


@pytest.fixture
def engines(model):
    made: list[Engine] = []

    def make(
        l3: str = "",
        l2_bytes: int = 1 << 20,
        mtp: int = K,
        prefix: str = "tiers",
        cache: bool = True,
        swa_pages: int = 24,
        checkpoint_pages: int = 0,
    ):
        hc = TieredCacheConfig(
            l2_bytes=l2_bytes if cache else 0,
            l3_url=l3 if cache else "",
            model_name=MODEL_NAME,
            prefetch_policy="wait_complete",
            swa_checkpoint_pages=checkpoint_pages,
        )
        sc = SchedulerConfig(max_tokens_per_step=64, chunk_tokens=24, max_running=4, dedup_min_tokens=16)
        ec = EngineConfig(
            max_prompt_tokens=400,
            max_new_tokens=64,
            prefix_cache=cache,
            scheduler=sc,
            cache_config=hc,
            mtp_layers=mtp,
            mtp_prefix=prefix,
        )
        e = Engine(model, DualKVCache(CFG, 64, swa_pages), ec)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def serve(engine: Engine, prompt, params=GREEDY):
    r = engine.add_request(prompt, params)
    for _ in range(20_000):
        if not engine.has_work():
            return r
        engine.step()
        engine.check_integrity()
    raise AssertionError("engine still busy")


def record_restores(engine: Engine) -> list:
    """Copies of every MTP state restored from a tail (right after its catch-up), with tokens."""
    spec, seen = engine.decoding, []
    real = spec._restore

    def restore(r, p):
        st = real(r, p)
        if st is not None:
            seen.append((p, list(r.tokens()), copy.deepcopy(st.k), copy.deepcopy(st.v), list(st.valid), st))
        return st

    spec._restore = restore
    return seen


def scratch_state(make, tokens, p: int):
    """The MTP state of a from-scratch prefill of tokens (no cache) once every depth passed
    p (positions are never rewritten once committed, so it holds what stood at p)."""
    e = make(cache=False, prefix="prefill")
    head, got = e.decoding.head, []
    real = head.step

    def step(st, h0, c_old, c_new, toks, drafts_max, pick=None):
        out = real(st, h0, c_old, c_new, toks, drafts_max, pick)
        if not got and min(st.valid) >= p:
            got.append(copy.deepcopy(st))
        return out

    head.step = step
    serve(e, tokens, SamplingParams(max_tokens=4, temperature=0.0))
    assert got, f"the prefill never passed {p}"
    return got[0]


def assert_state_is_from_scratch(make, model: Model, seen: list, bitwise: bool = True) -> None:
    """The restored state equals a from-scratch prefill's at every position a later window
    reads: bit for bit (float64) where it came from the tail (positions < P - K; when its
    writer computed them in the same chunks as the from-scratch prefill), to rounding
    where the catch-up recomputed it (the last K: another batch shape), and the dense
    reference's to rounding everywhere. A wrong tail is off by O(1), not 1e-15."""
    assert seen, "no MTP state came from a tail"
    head = MTPHead(model, K)
    for p, tokens, k, v, valid, st in seen:
        for ref, scratch in ((scratch_state(make, tokens, p), True), (head.reference_state(tokens, p), False)):
            if not scratch:
                assert valid == ref.valid
            for d in range(K):
                pos = np.arange(max(0, valid[d] - W), valid[d])
                stored = pos < p - K
                for got, want in (
                    (k[d, pos % st.cap], ref.k[d, pos % ref.cap]),
                    (v[d, pos % st.cap], ref.v[d, pos % ref.cap]),
                ):
                    if scratch and bitwise:
                        np.testing.assert_array_equal(got[stored], want[stored])
                    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def plain_output(make, prompt, params=LONG) -> list[int]:
    e = make(mtp=0, cache=False)
    return serve(e, prompt, params).output


@pytest.mark.parametrize("tier", ["l1", "l2"])
def test_prefix_from_l1_or_l2_brings_its_mtp_tail(engines, model, tier):
    e = engines()
    serve(e, upto(PAGES))
    if tier == "l2":
        assert e.cache.evict(10**6, 10**6) != (0, 0) and e.tree.cached_pages() == (0, 0)
        e.scheduler.tree_changed()
        assert not e.cache.mtp.l1.blobs and e.cache.mtp.l2.blobs  # the tails went down with the pages
    seen = record_restores(e)
    again = serve(e, upto(PAGES, [7]), LONG)
    assert again.cached_by_tier[tier] == PAGES * PS and again.cached_tokens == PAGES * PS
    assert e.cache.mtp.stats[f"hits_{tier}"] == 1 and e.cache.mtp.stats["misses"] == 0
    snap = e.metrics.snapshot()
    assert snap[f"mtp_tail_hits_{tier}_total"] == 1 and snap["mtp_rebuilt_tokens_total"] == 0
    assert again.output == plain_output(engines, upto(PAGES, [7]))
    assert_state_is_from_scratch(engines, model, seen)


def test_a_restored_state_writes_exact_tails_of_its_own(engines, model):
    """A request that resumed from a tail is exact: the tails it writes are right in turn."""
    e = engines()
    serve(e, upto(12))
    second = serve(e, upto(PAGES))
    assert second.cached_tokens == 12 * PS and e.cache.mtp.stats["hits_l1"] == 1
    assert e.cache.evict(10**6, 10**6) != (0, 0)
    e.scheduler.tree_changed()
    seen = record_restores(e)
    third = serve(e, upto(PAGES, [7]), LONG)
    assert third.cached_by_tier["l2"] == PAGES * PS and e.cache.mtp.stats["hits_l2"] == 1
    assert third.output == plain_output(engines, upto(PAGES, [7]))
    # the second request computed [96, 146) in other chunks than a prefill from 0: rounding only
    assert_state_is_from_scratch(engines, model, seen, bitwise=False)


def test_the_first_reuse_rebuilds_exactly_and_keeps_its_branch_point_tail(engines, model):
    """B = S + q2 after A = S + q1 resumes at a spare point of A's path in L1 (page S), where A
    wrote no tail (A's checkpoints are its ends). The prefix's SWA is live there all the way
    back, so the rebuild reaches K * W back and is exact, and B writes the tail of its branch
    point (a checkpoint). C = S + q3, after the tree let go of everything, gets prefix and
    tail from L2 without a rebuild, in the state a prefill of S leaves."""
    s_pages = 20
    shared = SHARED[: s_pages * PS]
    q1, q2, q3 = [11, 12, 13, 14] * 3, [21, 22, 23, 24] * 3, [31, 32, 33, 34] * 3
    e = engines(swa_pages=64)  # room for A's spare SWA pages: the first reuse finds them
    a = serve(e, shared + q1)
    tails, branch_key = e.cache.mtp, a.page_keys(s_pages)[-1]
    assert tails.stats["puts"] and branch_key not in tails.l1.blobs
    b = serve(e, shared + q2, LONG)
    snap = e.metrics.snapshot()
    assert b.cached_by_tier["l1"] == s_pages * PS
    assert snap["mtp_tail_misses_total"] == 1 and snap["mtp_rebuilt_tokens_total"] == K * W
    assert branch_key in tails.l1.blobs  # the exact rebuild wrote the branch point's tail
    assert b.output == plain_output(engines, shared + q2)
    assert e.cache.evict(10**6, 10**6) != (0, 0) and e.tree.cached_pages() == (0, 0)
    e.scheduler.tree_changed()
    assert branch_key in tails.l2.blobs
    seen = record_restores(e)
    c = serve(e, shared + q3, LONG)
    assert c.cached_by_tier["l2"] == s_pages * PS
    assert tails.stats["hits_l2"] == 1 and e.metrics.snapshot()["mtp_rebuilt_tokens_total"] == K * W
    assert c.output == plain_output(engines, shared + q3)
    assert_state_is_from_scratch(engines, model, seen, bitwise=False)


def test_periodic_checkpoints_get_their_tails_at_prefill(engines, model):
    """With a checkpoint every 4 pages the prefill writes a tail at each one it passes, though
    its chunks (24 tokens) cross them mid-chunk; a later prefix that ends at one of them (from
    L2, after the tree let go of everything) restores it without a rebuild."""
    e = engines(checkpoint_pages=4, swa_pages=64)
    a = serve(e, SHARED[:190])
    keys = a.page_keys(23)
    assert all(keys[n - 1] in e.cache.mtp.l1.blobs for n in (4, 8, 12, 16, 20))
    assert e.cache.evict(10**6, 10**6) != (0, 0) and e.tree.cached_pages() == (0, 0)
    e.scheduler.tree_changed()
    seen = record_restores(e)
    prompt = SHARED[: 12 * PS] + [7, 8, 9, 10, 11]
    b = serve(e, prompt, LONG)
    assert b.cached_by_tier["l2"] == 12 * PS
    assert e.cache.mtp.stats["hits_l2"] == 1 and e.metrics.snapshot()["mtp_rebuilt_tokens_total"] == 0
    assert b.output == plain_output(engines, prompt)
    assert_state_is_from_scratch(engines, model, seen, bitwise=False)


@pytest.mark.process
def test_prefix_from_l3_on_another_worker_and_after_a_restart(server, engines, model):
    writer = engines(server.address)
    serve(writer, upto(PAGES))
    assert writer.cache.l3.drain(timeout_s=20.0)
    writer.close()  # a restart: L1 and L2 gone, L3 keeps pages and tails
    b = engines(server.address)
    seen = record_restores(b)
    got = serve(b, upto(PAGES, [7]), LONG)
    assert got.cached_by_tier["l3"] == PAGES * PS
    assert b.cache.mtp.stats["hits_l3"] == 1 and b.metrics.snapshot()["mtp_rebuilt_tokens_total"] == 0
    assert got.output == plain_output(engines, upto(PAGES, [7]))
    assert_state_is_from_scratch(engines, model, seen)


def test_a_corrupt_l1_tail_falls_back_to_the_rebuild(engines, model):
    e = engines(l2_bytes=0)  # L1 only: nothing below to fall back on
    serve(e, upto(PAGES))
    blobs = e.cache.mtp.l1.blobs
    key = next(k for k in blobs)
    b = bytearray(blobs[key])
    b[100] ^= 0xFF
    blobs[key] = bytes(b)
    again = serve(e, upto(PAGES, [7]), LONG)
    assert again.cached_tokens == PAGES * PS
    stats = e.cache.mtp.stats
    assert stats["bad"] == 1 and stats["hits_l1"] == 0 and stats["misses"] == 1
    assert e.metrics.snapshot()["mtp_rebuilt_tokens_total"] > 0  # the fallback ran
    assert again.output == plain_output(engines, upto(PAGES, [7]))


@pytest.mark.process
@pytest.mark.parametrize("fault", ["missing", "garbage"])
def test_a_missing_or_bad_l3_tail_falls_back_to_the_rebuild(server, engines, model, fault):
    writer = engines(server.address)
    serve(writer, upto(PAGES))
    assert writer.cache.l3.drain(timeout_s=20.0)
    l3 = KeyBuilder(model=MODEL_NAME).key(next(iter(writer.cache.mtp.l1.blobs)), POOL_MTP)
    writer.close()
    c = gcache.Client(server.address)
    assert c.is_exist(l3)
    assert c.remove(l3)
    if fault == "garbage":  # bytes whose checksum trailer does not match (values are write-once)
        assert c.put(l3, b"\x00" * 5000)
    c.close()
    b = engines(server.address)
    got = serve(b, upto(PAGES, [7]), LONG)
    assert got.cached_by_tier["l3"] == PAGES * PS
    stats = b.cache.mtp.stats
    assert stats["hits_l3"] == 0 and stats["misses"] == 1 and stats["bad"] == (fault == "garbage")
    assert b.metrics.snapshot()["mtp_rebuilt_tokens_total"] > 0  # the fallback ran
    assert got.output == plain_output(engines, upto(PAGES, [7]))


def test_a_tail_of_another_geometry_is_never_used(model):
    head3, head2 = MTPHead(model, 3), MTPHead(model, 2)
    toks = SHARED[:100]
    st = head3.reference_state(toks, 80)
    body = mtp_tail.encode(st, 80, CFG)
    assert body is not None and mtp_tail.decode(body, head3, 80, None) is not None
    assert mtp_tail.decode(body, head2, 80, None) is None  # other depths
    assert mtp_tail.decode(body, head3, 72, None) is None  # another length under a wrong key
    assert mtp_tail.decode(body[:-8], head3, 80, None) is None  # truncated


class RecordingClient:
    """A client that records the thread of every put and can hold puts at a gate (to fill
    the write queue without timing: the writer thread is parked inside a put)."""

    def __init__(self, inner=None, gated: bool = False) -> None:
        self.inner, self.put_threads, self.stored = inner, [], {}
        self.gate, self.entered = threading.Event(), threading.Event()
        if not gated:
            self.gate.set()
        self.fail_keys: set = set()

    def put(self, key, value) -> bool:
        self.put_threads.append(threading.current_thread())
        self.entered.set()
        assert self.gate.wait(timeout=60.0), "test gate never opened"
        if key in self.fail_keys:
            raise gcache.errors.GCacheError("injected put failure")
        self.stored[key] = bytes(value)
        return self.inner.put(key, value) if self.inner is not None else True

    def __getattr__(self, name):
        if self.inner is None:
            if name in ("register_buffer", "close"):
                return lambda *a, **k: None
            raise AttributeError(name)
        return getattr(self.inner, name)


def l3_store(client, url: str = "gcache://127.0.0.1:1", write_queue_max: int = 256) -> L3Store:
    host = HostCache(HostKVPool(CFG, 4, 2, xp=np))
    return L3Store(L3Config(url=url, model=MODEL_NAME, write_queue_max=write_queue_max), host, W, PS, client=client)


@pytest.mark.process
def test_an_l3_tail_is_written_off_the_callers_thread_and_readable_after_drain(server):
    rec = RecordingClient(gcache.Client(server.address))
    l3 = l3_store(rec, server.address)
    try:
        tails = MTPTails(1 << 20, 1 << 20, l3)
        body = bytes(range(256)) * 300  # ~77 KB, the size of a real tail
        tails.put("page-hash-a", body)
        assert tails.l1.get("page-hash-a") == seal(body)  # the upper tiers have it at once
        assert l3.drain(timeout_s=20.0)
        assert rec.put_threads and all(t is not threading.current_thread() for t in rec.put_threads)
        assert all(t.name.startswith("l3-writer") for t in rec.put_threads)
        other = gcache.Client(server.address)  # a second worker's client
        try:
            assert bytes(other.get(KeyBuilder(model=MODEL_NAME).key("page-hash-a", POOL_MTP))) == seal(body)
        finally:
            other.close()
        assert tails.stats["l3_put_dropped"] == 0 and tails.stats["l3_put_errors"] == 0
        assert l3.stats["blob_writes_queued"] == 1 and l3.stats["blob_write_bytes"] == len(seal(body))
    finally:
        l3.close()


def test_a_full_l3_queue_drops_the_tail_and_counts_it_without_blocking():
    rec = RecordingClient(gated=True)
    l3 = l3_store(rec, write_queue_max=1)
    try:
        tails = MTPTails(1 << 20, 1 << 20, l3)
        tails.put("a", b"A" * 1000)
        assert rec.entered.wait(timeout=60.0)  # the writer thread holds "a" inside its put
        tails.put("b", b"B" * 1000)  # fills the one-slot queue
        tails.put("c", b"C" * 1000)  # returns at once: dropped, counted
        assert tails.stats["l3_put_dropped"] == 1 and l3.stats["blob_writes_dropped"] == 1
        assert not l3.idle() and not l3.drain(timeout_s=0.05)  # drain waits for queued tails
        rec.fail_keys.add(tails._l3_key("b"))
        rec.gate.set()
        assert l3.drain(timeout_s=20.0)
        assert set(rec.stored) == {tails._l3_key("a")}  # "b" failed, "c" never went
        assert tails.stats["l3_put_errors"] == 1 and l3.stats["blob_write_errors"] == 1
        for k in "abc":  # every tail is still served from L1
            assert tails.get(k) is not None
        assert all(t.name.startswith("l3-writer") for t in rec.put_threads)
    finally:
        l3.close()
