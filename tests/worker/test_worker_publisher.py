"""The worker's publisher against a real redis-server: through a real EngineThread, with
Redis hung or killed under it (the engine never waits on Redis, buffers stay bounded, the
state heals by a resync), and with a real gcache-server as L3 (a prefix L3 holds counts for
a worker that never saw it)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import threading

import numpy as np
import pytest

from gcache.router.config import RouterConfig
from gcache.router.core import RouterCore
from gcache.serving.stop_text import OutputText
from gcache.serving.tokenizer import ByteTokenizer
from gcache.worker.engine.engine_thread import EngineThread, Pending
from gcache.worker.engine.messages import Finished, Rejected
from gcache.worker.engine.request import SamplingParams
from gcache.worker.http.publisher import PublisherConfig, WorkerPublisher, add_publisher_args, start_publisher
from gcache.worker.model.transformer import Model
from tests.support import waiting
from tests.support.router_support import CFG, engine, history, run, tokens

wait_until = functools.partial(waiting.wait_until, timeout_s=20.0, step_s=0.02)

URL_A, URL_B = "http://127.0.0.1:9101", "http://127.0.0.1:9102"


@pytest.fixture(scope="module")
def model():
    return Model(CFG)


def view_of(core: RouterCore, url: str) -> dict:
    with core.view.lock:
        w = core.view.workers.get(url)
        return dict(w.flags) if w is not None else {}


class Client:
    """Submits prompts to an EngineThread the way the HTTP handlers do (an asyncio loop)."""

    def __init__(self, et: EngineThread) -> None:
        self.et = et
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def complete(self, prompt: list[int], max_tokens: int = 4):
        async def go():
            p = Pending(
                prompt,
                SamplingParams(max_tokens=max_tokens),
                OutputText(ByteTokenizer(CFG.vocab_size)),
                False,
                asyncio.get_running_loop(),
            )
            self.et.submit(p)
            while True:
                msg = await asyncio.wait_for(p.events.get(), 30)
                if isinstance(msg, Finished):
                    return msg.request
                if isinstance(msg, Rejected):
                    raise msg.error

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_engine_thread_hook_publishes_and_a_router_routes_to_it(model, redis_proc):
    eng = engine(model)
    et = EngineThread(eng, inbox_max=8, integrity_check_s=0)
    ap = argparse.ArgumentParser()
    add_publisher_args(ap)
    args = ap.parse_args(["--redis", redis_proc.url, "--advertise-url", URL_A, "--publish-interval-s", "0.02"])
    args.host, args.port, args.model_name = "127.0.0.1", 0, "m"
    pub = start_publisher(args, et)
    et.start()
    client = Client(et)
    core = RouterCore(RouterConfig(redis_url=redis_proc.url, refresh_interval_s=0))
    try:
        rng = np.random.default_rng(4)
        prompt = tokens(rng, 77)
        r = client.complete(prompt)
        follow = history(r) + tokens(rng, 5)

        def routed_with_cache() -> bool:
            core.refresh()
            return URL_A in core.workers() and core.explain(follow)[URL_A]["l1"] > 0

        wait_until(routed_with_cache)
        assert core.pick(follow) == URL_A
        assert client.complete(follow).cached_tokens == core.explain(follow)[URL_A]["l1"]
        assert et.hook_errors == 0
    finally:
        client.close()
        et.stopping.set()
        et.join(10)
        pub.stop()
    assert core.refresh() and core.workers() == []  # deregistered: out of routing at once


@pytest.mark.timeout(120)
def test_hung_redis_never_blocks_the_engine_and_buffers_stay_bounded(model, redis_proc):
    """Redis stopped (SIGSTOP: connections hang) with a 20 s Redis timeout: if a step hook
    ever waited on Redis, every step would take 20 s and this test would time out."""
    eng = engine(model, full_pages=48, swa_pages=24)
    cfg = PublisherConfig(redis_proc.url, URL_A, interval_s=0.01, ttl_s=60, events_max=8, redis_timeout_s=20)
    pub = WorkerPublisher(eng, cfg, start_thread=True)
    rng = np.random.default_rng(8)
    run(eng, [tokens(rng, 20)], pub)
    wait_until(lambda: pub.counters["flushes"] >= 1)
    redis_proc.pause()
    sizes = []
    try:
        run(
            eng,
            [tokens(rng, int(rng.integers(20, 90))) for _ in range(12)],
            pub,
            after_step=lambda: sizes.append(len(pub.events.dirty) + len(pub.events.l3)),
        )
    finally:
        redis_proc.resume()
    assert max(sizes) <= 8 and pub.events.stats["dropped"] > 0
    flushes = pub.counters["flushes"]
    wait_until(lambda: pub.counters["flushes"] > flushes + 1)  # back: the next flushes go through
    pub.stop(deregister=False)
    pub.flush()  # stopped thread: write whatever is left, synchronously
    core = RouterCore(RouterConfig(redis_url=redis_proc.url, refresh_interval_s=0))
    assert core.refresh()
    assert pub.events.rebuild() == 0 and view_of(core, URL_A) == pub.events.mirror


def test_killed_redis_heals_with_a_resync(model, redis_proc):
    eng = engine(model, full_pages=48, swa_pages=24)
    pub = WorkerPublisher(
        eng, PublisherConfig(redis_proc.url, URL_A, interval_s=0, ttl_s=60, events_max=4), start_thread=False
    )
    rng = np.random.default_rng(9)
    run(eng, [tokens(rng, 40)], pub)
    assert pub.flush()
    redis_proc.kill9()
    for _ in range(3):
        run(eng, [tokens(rng, 50)], pub)
        assert not pub.flush()
        assert len(pub.events.dirty) <= 4
    assert pub.counters["flush_errors"] == 3
    redis_proc.start()
    assert pub.flush() and pub.counters["resyncs"] == 2
    core = RouterCore(RouterConfig(redis_url=redis_proc.url, refresh_interval_s=0))
    assert core.refresh() and view_of(core, URL_A) == pub.events.mirror and pub.events.rebuild() == 0
    pub.stop()


def test_prefix_in_l3_counts_for_a_worker_that_never_saw_it(model, redis_proc, server):
    l3 = dict(l2_bytes=256 << 10, l3_url=server.address, prefetch_policy="wait_complete")
    a, b = engine(model, **l3), engine(model, **l3)
    pa = WorkerPublisher(a, PublisherConfig(redis_proc.url, URL_A, interval_s=0, ttl_s=60), start_thread=False)
    pb = WorkerPublisher(b, PublisherConfig(redis_proc.url, URL_B, interval_s=0, ttl_s=60), start_thread=False)
    rng = np.random.default_rng(12)
    prompt = tokens(rng, 88)
    r = run(a, [prompt], pa)[0]
    assert a.cache.l3.drain(20)
    pb.on_step(b)
    assert pa.flush() and pb.flush()
    core = RouterCore(RouterConfig(redis_url=redis_proc.url, refresh_interval_s=0))
    assert core.refresh() and len(core.view.l3) > 0
    follow = history(r) + tokens(rng, 3)
    seen = core.explain(follow)
    assert seen[URL_B]["l1"] == seen[URL_B]["l2"] == 0 and seen[URL_B]["l3"] > 0
    assert seen[URL_A]["l1"] > 0 and core.pick(follow) == URL_A  # device beats L3
    got = run(b, [follow], pb)[0]
    assert got.cached_by_tier["l3"] == seen[URL_B]["l3"]  # what B really loaded from L3
    for p, e in ((pa, a), (pb, b)):
        p.stop()
        e.close()
