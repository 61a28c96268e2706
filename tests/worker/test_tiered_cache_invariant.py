"""The invariant of the cache hierarchy: output with L1 (device) / L2 (host) / L3 (a real
gcache-server) equals output without any cache, token for token, whatever tier a prefix
comes from, and logits match the dense float64 reference.

Each scenario asserts the exact split of the hit across tiers where the scenario fixes it
(prefetch_policy="wait_complete": a request is admitted only once its L3 read is done).
Faults are real: keys removed from the server, wrong-sized values, a byte flipped in a
disk segment, the server killed, SIGSTOPped and restarted on its data dir. Every loop is
bounded by a step count and check_integrity() runs after every step.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matmuls: threads only add contention

import signal
import time
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gcache
from gcache.common.attention import AttentionKind
from gcache.wire.keys import KeyBuilder
from gcache.worker.engine.engine import Engine
from gcache.worker.engine.request import Request, SamplingParams
from gcache.worker.integrity import IntegrityError
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.model.transformer import Model
from tests.support.reference import check_against_reference
from tests.support.tiered_cache_support import CFG, build_engine

PS = CFG.page_size  # 8 tokens; the window is 4 pages
STEPS_MAX = 20_000  # no loop runs longer: a hung engine fails, never stalls the suite
MODEL_NAME = "invariant-m"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=5, temperature=0.8, seed=11)
SHARED = [int(t) for t in np.random.default_rng(1).integers(0, 256, size=200)]


def upto(pages: int, extra=()) -> list[int]:
    """The first pages * PS + 1 tokens of the shared text, then `extra`: with fewer than PS
    extra tokens, the longest prefix a cache may serve is exactly `pages` pages (one token
    is always left to compute)."""
    return SHARED[: pages * PS] + [SHARED[pages * PS], *extra]


def tiers(l1=0, l2=0, l3=0) -> dict:
    """Request.cached_by_tier for these page counts."""
    return {"l1": l1 * PS, "l2": l2 * PS, "l3": l3 * PS}


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CFG)


@pytest.fixture
def engines(model):
    """make(l3_url, ...) -> Engine with a real hierarchy; every engine is closed at teardown."""
    made: list[Engine] = []

    def make(
        l3: str = "",
        l2_bytes: int = 1 << 20,
        model_name: str = MODEL_NAME,
        full_pages: int = 64,
        swa_pages: int = 24,
        prefix_cache: bool = True,
        **cache_kw,
    ) -> Engine:
        cache_kw.setdefault("prefetch_policy", "wait_complete")
        hc = TieredCacheConfig(
            l2_bytes=l2_bytes if prefix_cache else 0,
            l3_url=l3 if prefix_cache else "",
            model_name=model_name,
            **cache_kw,
        )
        engine = build_engine(model, full_pages, swa_pages, hc, prefix_cache)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def step(engine: Engine) -> None:
    engine.step()
    engine.check_integrity()
    if not engine.last_step_ran:
        time.sleep(0.001)  # every waiting request waits on its L3 prefetch


def settle(engine: Engine, steps_max: int = STEPS_MAX) -> None:
    """Step until idle, integrity after every step; a bounded number of steps."""
    for _ in range(steps_max):
        if not engine.has_work():
            return
        step(engine)
    raise AssertionError(f"engine still busy after {steps_max} steps")


def serve(engine: Engine, prompt, params: SamplingParams = GREEDY) -> Request:
    r = engine.add_request(prompt, params, record_logits=True)
    settle(engine)
    return r


def evict_l1(engine: Engine, full_pages: int = 10**6, swa_pages: int = 10**6) -> bool:
    """Evict unlocked L1 pages (all by default); whether any went."""
    evicted = engine.cache.evict(full_pages, swa_pages) != (0, 0)
    if evicted:
        engine.scheduler.tree_changed()
    engine.check_integrity()
    return evicted


def evict_l2(engine: Engine, kind: str, pages: int) -> None:
    """Make `pages` more slots of `kind` free in L2 (evicting its LRU unpinned pages) and
    give them back: an L2 eviction through the host cache's own path."""
    host = engine.cache.host
    pool = host.pool.pools[kind]
    slots = host.reserve(kind, min(pool.num_pages, pool.num_free + pages))
    if slots:
        host.cancel(kind, slots)
    engine.check_integrity()


def drained(engine: Engine) -> None:
    """Every queued L3 write is done (bounded), so another engine can read it."""
    assert engine.cache.l3.drain(timeout_s=20.0), "L3 writes still queued after 20 s"
    engine.check_integrity()


def assert_invariant(make, model: Model, reqs: list[Request]) -> None:
    """Each request's tokens equal a no-cache engine's, its logits the dense reference's,
    and its per-tier split sums to its cached tokens."""
    plain = make(prefix_cache=False)
    ref = [plain.add_request(list(r.prompt), r.params) for r in reqs]
    settle(plain)
    for r, p in zip(reqs, ref):
        assert r.output == p.output, f"{r} differs from the no-cache run (cached {r.cached_by_tier})"
        check_against_reference(model, r)
        assert sum(r.cached_by_tier.values()) == r.cached_tokens
    assert sum(p.cached_tokens for p in ref) == 0


def seed_l3(make, address: str, pages=(18,), **cache_kw) -> Engine:
    """Another worker computes the shared text up to each of `pages` (each a checkpoint),
    and its L3 writes complete."""
    writer = make(address, **cache_kw)
    for p in pages:
        serve(writer, upto(p))
    drained(writer)
    return writer


# ---- 1. where the prefix comes from ---------------------------------------------------------


def test_prefix_from_l1(server, engines, model):
    e = engines(server.address)
    first = serve(e, upto(18))
    again = serve(e, upto(18, [7]), SAMPLED)
    assert first.cached_by_tier == tiers()
    assert again.cached_by_tier == tiers(l1=18)
    assert_invariant(engines, model, [first, again])


def test_prefix_from_l2_after_l1_eviction(server, engines, model):
    e = engines(server.address)
    first = serve(e, upto(18))
    assert evict_l1(e) and e.tree.cached_pages() == (0, 0)
    again = serve(e, upto(18, [7]), SAMPLED)
    assert again.cached_by_tier == tiers(l2=18)
    assert e.cache.stats()["l3_read_pages"] == 0  # L2 had it all: no L3 read
    assert_invariant(engines, model, [first, again])


def test_prefix_from_l3_on_another_worker(server, engines, model):
    seed_l3(engines, server.address)
    b = engines(server.address)
    got = serve(b, upto(18, [7]), SAMPLED)
    assert got.cached_by_tier == tiers(l3=18)
    assert b.cache.stats()["l3_read_bad_pages"] == 0
    assert_invariant(engines, model, [got])


def test_prefix_part_from_each_tier(server, engines, model):
    """L1 holds pages [0, 6), L2 [6, 12), L3 [12, 18): one request gets all three."""
    seed_l3(engines, server.address, pages=(6, 12, 18))  # checkpoints at 6, 12 and 18 pages
    b = engines(server.address)
    reqs = [serve(b, upto(6))]  # L2 + L1 get [0, 6) from L3
    reqs.append(serve(b, upto(12)))  # [0, 6) from L1, [6, 12) from L3
    assert evict_l1(b)  # L1 empty, L2 keeps [0, 12)
    reqs.append(serve(b, upto(6, [3])))  # [0, 6) back into L1 from L2
    reqs.append(serve(b, upto(18, [5]), SAMPLED))  # L1 [0, 6), L2 [6, 12), L3 [12, 18)
    assert [r.cached_by_tier for r in reqs] == [tiers(l3=6), tiers(l1=6, l3=6), tiers(l2=6), tiers(l1=6, l2=6, l3=6)]
    assert_invariant(engines, model, reqs)


# ---- 2. worker restart ------------------------------------------------------------------------


def test_restarted_worker_finds_its_pages_and_another_model_never_reads_them(server, engines, model):
    first = seed_l3(engines, server.address)
    first.close()  # the worker goes away; its L1 and L2 with it
    restarted = engines(server.address)
    hit = serve(restarted, upto(18, [7]))
    other = engines(server.address, model_name="another-model")
    miss = serve(other, upto(18, [7]))
    assert hit.cached_by_tier == tiers(l3=18)
    assert miss.cached_by_tier == tiers() and miss.cached_tokens == 0
    stats = other.cache.stats()
    assert stats["l3_read_pages"] == 0 and stats["l3_prefetch_hit"] == 0
    assert_invariant(engines, model, [hit, miss])


# ---- 3, 4. a page missing, wrong-sized or corrupt in L3 -----------------------------------------
# The writer keeps SWA checkpoints every 6 pages, so L3 holds full KV for pages [0, 18) and
# SWA KV for the window tails of 6, 12 and 18: pages 2-5, 8-11 and 14-17.


def l3_key(model_name: str, page_hash: str, pool: str) -> bytes:
    return KeyBuilder(model=model_name).key(page_hash, pool)


def chain() -> list[str]:
    return Request(upto(18), GREEDY, 0.0, page_size=PS).page_keys()


@pytest.mark.parametrize(
    "pool, page, expected_pages",
    [
        (AttentionKind.FULL, 9, 6),  # full KV gone mid-chain: the hit ends at the checkpoint before it (6)
        (AttentionKind.SWA, 10, 18),  # an SWA page of checkpoint 12: resuming at 18 never needs it
        (AttentionKind.SWA, 16, 12),  # an SWA page of the end's window: back to checkpoint 12
    ],
)
def test_page_missing_in_the_middle_of_an_l3_chain(server, engines, model, pool, page, expected_pages):
    seed_l3(engines, server.address, swa_checkpoint_pages=6)
    with gcache.Client(server.address) as c:
        assert c.remove(l3_key(MODEL_NAME, chain()[page], pool))
    reader = engines(server.address)
    got = serve(reader, upto(18, [7]), SAMPLED)
    assert got.cached_by_tier == tiers(l3=expected_pages)
    drained(reader)  # the reader recomputed the rest and wrote it back: L3 is whole again
    healed = serve(engines(server.address), upto(18, [9]))
    assert healed.cached_by_tier == tiers(l3=18)
    assert_invariant(engines, model, [got, healed])


@pytest.mark.parametrize("size", [0, 100, 4096 - 8, 4096 + 8, 3 * 4096])
def test_wrong_sized_l3_value_is_a_miss_from_there_on(server, engines, model, size):
    """A full page of 4096 bytes replaced by a value of another length: shorter ones are
    short reads, longer ones do not fit the host page; both cut the chain at that page and
    leave the store usable (no suspect period: the next request still reads L3)."""
    seed_l3(engines, server.address, swa_checkpoint_pages=6)
    key = l3_key(MODEL_NAME, chain()[9], AttentionKind.FULL)
    with gcache.Client(server.address) as c:
        assert c.remove(key)
        assert c.put(key, os.urandom(size))  # values are immutable: remove, then put
    reader = engines(server.address)
    got = serve(reader, upto(18, [7]), SAMPLED)
    assert got.cached_by_tier == tiers(l3=6)
    stats = reader.cache.stats()
    assert stats["l3_read_bad_pages"] == 1 and stats["l3_prefetch_failed"] == 0
    assert reader.cache.l3.available()
    assert_invariant(engines, model, [got])


def admin_flush(server) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{server.admin_port}/flush", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_corrupt_disk_record_is_a_miss_never_wrong_bytes(server, engines, model):
    """A byte flipped in a flushed record: the server's checksum turns the read into a miss
    and the chain is cut there."""
    seed_l3(engines, server.address, swa_checkpoint_pages=6)
    admin_flush(server)
    server.stop(signal.SIGKILL)
    key = l3_key(MODEL_NAME, chain()[9], AttentionKind.FULL)
    segments = sorted(server.data_dir.glob("seg-*.log"))
    hits = [(seg, seg.read_bytes().find(key)) for seg in segments]
    hits = [(seg, at) for seg, at in hits if at >= 0]
    assert len(hits) == 1, f"key in {len(hits)} segments"
    seg, at = hits[0]
    raw = bytearray(seg.read_bytes())
    assert raw.count(key) == 1
    raw[at + len(key) + 1000] ^= 0xFF  # inside the 4096-byte value that follows the key
    seg.write_bytes(raw)
    (server.data_dir / "warm.list").unlink(missing_ok=True)  # the value stays disk-only: a GET reads it
    server.start()  # same port, same data dir
    reader = engines(server.address)
    got = serve(reader, upto(18, [7]), SAMPLED)
    assert got.cached_by_tier == tiers(l3=6)
    assert reader.cache.stats()["l3_read_bad_pages"] == 1
    with gcache.Client(server.address) as c:
        assert c.stats()["counters"]["checksum_failures"] == 1
    assert_invariant(engines, model, [got])


# ---- 5. L3 down, slow, restarting -------------------------------------------------------------


def workload(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """n requests on the shared text, cut at various points, greedy and sampled."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pages = int(rng.integers(2, 19))
        extra = [int(t) for t in rng.integers(0, 256, size=int(rng.integers(0, 12)))]
        params = SamplingParams(max_tokens=int(rng.integers(1, 8)), temperature=[0.0, 0.9][i % 2], seed=i)
        out.append((upto(pages, extra), params))
    return out


def run_with_fault(engine: Engine, jobs, fault, later_jobs=()) -> list[Request]:
    """Submit jobs, call fault() once two of them are done (the others still waiting or
    running), then submit later_jobs; bounded steps, integrity after each."""
    reqs = [engine.add_request(p, params, record_logits=True) for p, params in jobs]
    for _ in range(STEPS_MAX):
        if sum(r.finish_reason is not None for r in reqs) >= 2:
            break
        step(engine)
    assert engine.has_work(), "the fault should land mid-workload"
    fault()
    late = [engine.add_request(p, params, record_logits=True) for p, params in later_jobs]
    settle(engine)
    return reqs + late


def forget_l1_and_l2(engine: Engine) -> None:
    evict_l1(engine)
    for kind in (AttentionKind.FULL, AttentionKind.SWA):
        evict_l2(engine, kind, engine.cache.host.pool.pools[kind].num_pages)
    assert engine.cache.host.used_pages() == (0, 0)


def wait_available(engine: Engine, timeout_s: float = 30.0) -> None:
    """After a failure the store is skipped for a while; wait (bounded) until it is tried again."""
    deadline = time.monotonic() + timeout_s
    while not engine.cache.l3.available():
        assert time.monotonic() < deadline, "L3 still marked down"
        time.sleep(0.05)


def test_l3_down_from_the_start(server, engines, model):
    address = server.address
    server.stop(signal.SIGKILL)
    e = engines(address, l3_timeout_s=0.3)
    first = serve(e, upto(18))
    assert evict_l1(e)
    again = serve(e, upto(18, [7]), SAMPLED)
    assert first.cached_by_tier == tiers()
    assert again.cached_by_tier == tiers(l2=18)  # L2 does not need L3
    assert e.cache.stats()["l3_read_pages"] == 0
    assert_invariant(engines, model, [first, again])


def test_l3_killed_mid_workload(server, engines, model):
    seed_l3(engines, server.address, pages=(6, 12, 18))
    e = engines(server.address, l3_timeout_s=0.3)
    reqs = run_with_fault(
        e, workload(6, seed=2), fault=lambda: server.stop(signal.SIGKILL), later_jobs=workload(4, seed=3)
    )
    for r in reqs[6:]:
        assert r.cached_by_tier["l3"] == 0  # read after the kill: nothing can come from L3
    assert_invariant(engines, model, reqs)


BACK_TRIES = 5  # reads of the seeded prefix after a fault, until one comes from L3


def assert_l3_serves_again(e: Engine, engines, model, reqs: list) -> None:
    """Once L3 is back, the same worker (L1 and L2 emptied) gets the seeded prefix from it
    again, and every answer of the fault run equals the no-cache answer.

    A read may still fail on a machine too loaded for the short l3_timeout_s (the store just
    resumed, the CPU is busy): then that request got nothing from L3 and the failure was
    counted, and it is tried again (bounded). Any other outcome, a partial hit, a miss or an
    uncounted failure, fails the test."""
    back = []
    for _ in range(BACK_TRIES):
        drained(e)  # first: a queued write that fails now cannot make L3 suspect after the next line
        wait_available(e)
        forget_l1_and_l2(e)
        failed_before = e.cache.stats()["l3_prefetch_failed"]
        back.append(serve(e, upto(18, [7]), SAMPLED))
        drained(e)  # the prefetch threads are idle: their counters are final
        if back[-1].cached_by_tier == tiers(l3=18):
            break
        assert back[-1].cached_by_tier == tiers(), back[-1].cached_by_tier
        assert e.cache.stats()["l3_prefetch_failed"] > failed_before, "an L3 read that was not a hit, not counted"
    else:
        raise AssertionError(f"L3 never served the prefix again in {BACK_TRIES} tries")
    assert_invariant(engines, model, reqs + back)


def test_l3_slow_then_back(server, engines, model):
    """A SIGSTOPped server: alive and connected, but every L3 call times out (0.3 s).

    Guards, whatever the timing: a store that stops answering costs misses, never wrong
    bytes and never a hung engine (every request finishes, token for token the no-cache
    answer, the integrity check passing after every step); nothing comes from L3 while it
    is stopped; every prefetch started then ends counted (none left pending, none a hit:
    the store answered nothing; the first one a failure); the worker reports L3
    unreachable; after SIGCONT the same worker uses the store again and gets exactly what
    it held. Counters are read only once the L3 threads are idle (drain), never at a
    moment a background thread may not have reached yet."""
    seed_l3(engines, server.address)
    e = engines(server.address, l3_timeout_s=0.3)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        reqs = [serve(e, p, params) for p, params in workload(3, seed=4)]
        assert all(r.cached_by_tier["l3"] == 0 for r in reqs)
        drained(e)  # still stopped: queued writes fail on their timeouts; prefetches are done
        stats = e.cache.stats()
        assert stats["l3_prefetches"] >= 1  # the first request looked (L3 had not failed yet)
        assert stats["l3_prefetch_hit"] == 0 and stats["l3_read_pages"] == 0
        assert stats["l3_prefetch_failed"] >= 1  # the first one asked the stopped store
        # A later prefetch may need nothing of the store (its pages are in L1/L2 by then: a
        # miss, decided without a call) or be cancelled; none is left pending.
        ended = stats["l3_prefetch_failed"] + stats["l3_prefetch_cancelled"] + stats["l3_prefetch_miss"]
        assert ended == stats["l3_prefetches"]
        assert e.cache.l3.health()["state"] == "unreachable"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert_l3_serves_again(e, engines, model, reqs)


def test_l3_restarting_mid_workload(server, engines, model):
    """Killed and restarted on the same data dir while requests run: what was flushed to
    disk before is served again, to the same worker, after the restart."""
    seed_l3(engines, server.address, pages=(6, 12, 18))
    admin_flush(server)
    e = engines(server.address, l3_timeout_s=0.3)

    def restart():
        server.stop(signal.SIGKILL)
        for _ in range(20):  # requests keep running while it is down
            if e.has_work():
                step(e)
        server.start()  # same port, same data dir

    reqs = run_with_fault(e, workload(6, seed=5), fault=restart, later_jobs=workload(4, seed=6))
    assert_l3_serves_again(e, engines, model, reqs)


# ---- 6. random workloads on tiny pools, a tiny L2 and a real L3 ----------------------------------


@st.composite
def hierarchy_workloads(draw):
    n_prefixes = draw(st.integers(1, 3))
    prefixes = [draw(st.lists(st.integers(0, 255), min_size=1, max_size=90)) for _ in range(n_prefixes)]
    script, n_req = [], 0
    for _ in range(draw(st.integers(3, 14))):
        kind = draw(st.sampled_from(["new", "new", "turn", "turn", "step", "evict_l1", "evict_l2", "restart"]))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 20)),
            temperature=draw(st.sampled_from([0.0, 0.0, 0.7])),
            seed=draw(st.integers(0, 1000)),
        )
        suffix = draw(st.lists(st.integers(0, 255), min_size=0, max_size=30))
        if kind == "step":
            script.append(("step", draw(st.integers(1, 20))))
        elif kind == "evict_l1":
            script.append(("evict_l1", draw(st.integers(0, 40)), draw(st.integers(0, 16))))
        elif kind == "evict_l2":
            script.append(
                ("evict_l2", draw(st.sampled_from([AttentionKind.FULL, AttentionKind.SWA])), draw(st.integers(1, 20)))
            )
        elif kind == "restart":
            script.append(("restart",))
        elif kind == "turn" and n_req:
            script.append(("submit", draw(st.integers(0, n_req - 1)), suffix, params))
            n_req += 1
        else:
            script.append(("submit", None, draw(st.sampled_from(prefixes)) + suffix, params))
            n_req += 1
    return script


def turn_prompt(reqs: list[Request], op) -> list[int]:
    """A new request, or the next turn of request op[1]: its prompt + answer + new tokens."""
    _, src, suffix, _ = op
    if src is None:
        return suffix
    return (list(reqs[src].prompt) + reqs[src].output)[:150] + suffix


_example_ids = itertools.count()


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    script=hierarchy_workloads(),
    full_pages=st.integers(28, 48),
    swa_pages=st.integers(12, 16),
    l2_full_pages=st.integers(6, 40),
    checkpoint_pages=st.sampled_from([0, 0, 3]),
)
def test_random_workloads_through_every_tier(
    model, engines, server, script, full_pages, swa_pages, l2_full_pages, checkpoint_pages
):
    """Tiny device pools and a tiny L2 over a real L3; turns wait for their source (the
    prompt must be known); evictions in L1 and L2 and worker restarts are script steps.
    Each example has its own model name, so its L3 pages are its own."""
    name = f"hyp-{next(_example_ids)}"
    l2_bytes = l2_full_pages * (4096 + 12288 // 2)  # ratio 0.5: half as many SWA slots
    make = lambda: engines(
        server.address,
        model_name=name,
        full_pages=full_pages,
        swa_pages=swa_pages,
        l2_bytes=l2_bytes,
        l2_swa_full_ratio=0.5,
        swa_checkpoint_pages=checkpoint_pages,
    )
    engine = make()
    got: list[Request] = []
    try:
        for op in script:
            if op[0] == "submit":
                if op[1] is not None:
                    settle(engine)
                got.append(engine.add_request(turn_prompt(got, op), op[3], record_logits=True))
            elif op[0] == "step":
                for _ in range(op[1]):
                    if engine.has_work():
                        step(engine)
            elif op[0] == "evict_l1":
                if evict_l1(engine, op[1], op[2]):
                    event("evicted L1")
            elif op[0] == "evict_l2":
                before = engine.cache.host.stats["evicted_full"] + engine.cache.host.stats["evicted_swa"]
                evict_l2(engine, op[1], op[2])
                if engine.cache.host.stats["evicted_full"] + engine.cache.host.stats["evicted_swa"] > before:
                    event("evicted L2")
            else:  # restart: the worker finishes its requests and a new one takes over
                settle(engine)
                drained(engine)
                engine.close()
                engine = make()
                event("restarted")
        settle(engine)
    finally:
        engine.close()
    # The same script, no cache at all: turns are built from this run's own answers.
    plain = engines(prefix_cache=False, full_pages=full_pages, swa_pages=swa_pages)
    ref: list[Request] = []
    for op in script:
        if op[0] == "submit":
            if op[1] is not None:
                settle(plain)
            ref.append(plain.add_request(turn_prompt(ref, op), op[3]))
    settle(plain)
    plain.close()
    for r, p in zip(got, ref):
        assert list(r.prompt) == list(p.prompt) and r.output == p.output, f"{r} differs from the no-cache run"
        check_against_reference(model, r)
        assert sum(r.cached_by_tier.values()) == r.cached_tokens
    for tier in ("l1", "l2", "l3"):
        if any(r.cached_by_tier[tier] for r in got):
            event(f"hit {tier}")  # --hypothesis-show-statistics shows how often each tier served


# ---- integrity checks do not depend on assert -----------------------------------------------


def test_integrity_check_catches_a_stray_host_pin_and_a_leaked_host_slot(engines):
    """python -O strips asserts; these checks must still fire (run this file with -O too)."""
    e = engines()  # L1 + L2, no L3
    r = serve(e, upto(6))
    key = r.page_keys()[0]
    assert e.cache.host.pin([key]) == [key]  # a pin nobody holds
    with pytest.raises(IntegrityError, match="host pins"):
        e.check_integrity()
    e.cache.host.unpin([key])
    e.check_integrity()
    e.cache.host.pool.pools[AttentionKind.FULL].alloc(1)  # a slot nobody holds
    with pytest.raises(IntegrityError, match="leaked"):
        e.check_integrity()
