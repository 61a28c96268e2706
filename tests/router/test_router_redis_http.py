"""End to end through real processes: redis-server, two gcache-workers publishing to it (--redis),
two gcache-routers discovering them from it. A conversation alternates between the routers and
stays on one worker (its prefix is there); Redis killed -9 mid-run fails no request, nor does
the gap after it comes back empty, before the workers re-register; a killed worker is retried
around and leaves routing.

The workers reach Redis through a TcpGate (a real TCP forwarder the test can cut), so the
test holds that gap open for as long as it sends requests into it, instead of racing the
publishers' retry."""

from __future__ import annotations

import functools
import json

import pytest

from tests.support import waiting
from tests.support.redis_support import TcpGate, start_redis
from tests.support.serving_support import RouterProc, WorkerProc, metric, openai_client, post_json, request, start_all

pytestmark = pytest.mark.process  # starts processes

openai = pytest.importorskip("openai")

WAIT_S = 30.0
wait_until = functools.partial(waiting.wait_until, timeout_s=WAIT_S, step_s=0.05)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
DOC = "A shared document that every turn of this conversation starts with. " * 3


def health(r) -> dict:
    return json.loads(request(r.port, "GET", "/health")[1])


@pytest.fixture
def cluster(tmp_path):
    redis = start_redis()
    gate = TcpGate(redis.port).start()
    procs = []
    try:
        # worker-grace-s bounds how long a router waits for a worker to re-register after Redis
        # lost it; the test keeps that gap open only while it sends a few requests.
        workers = [
            WorkerProc(
                tmp_path,
                [
                    "--redis",
                    f"redis://127.0.0.1:{gate.port}/0",
                    "--publish-interval-s",
                    "0.05",
                    "--publish-ttl-s",
                    "1.5",
                ],
            )
            for _ in range(2)
        ]
        routers = [
            RouterProc(tmp_path, None, ["--redis", redis.url, "--policy", "cache_aware", "--worker-grace-s", "20"])
            for _ in range(2)
        ]
        procs += workers + routers
        start_all(workers + routers)  # a router answers /health 200 once it sees a worker
        urls = sorted(w.url for w in workers)
        for r in routers:
            wait_until(lambda r=r: sorted(w["url"] for w in health(r)["workers"]) == urls, "routers see both workers")
        yield redis, gate, workers, routers
    finally:
        for p in procs:
            p.kill()
        gate.close()
        redis.close()


def pages_seen(router, url: str) -> int:
    return next((w["pages"] for w in health(router)["workers"] if w["url"] == url), 0)


def test_conversation_alternating_routers_stays_on_its_worker_and_survives_redis_and_worker_loss(cluster):
    redis, gate, workers, routers = cluster
    clients = [openai_client(r.url) for r in routers]
    by_url = {w.url: w for w in workers}
    prompt, home = DOC, None
    for turn in range(4):  # turn k goes through router k % 2
        raw = clients[turn % 2].completions.with_raw_response.create(model="any", prompt=prompt, max_tokens=8, **GREEDY)
        c, url = raw.parse(), raw.headers["x-gcache-worker"]
        if home is None:
            home = url
        assert url == home, f"turn {turn} left the worker holding its prefix"
        if turn:
            assert c.usage.prompt_tokens_details.cached_tokens >= len(DOC) - 8  # the prefix was there
        prompt = prompt + c.choices[0].text + f" Next question {turn}? "
        # Both routers see the new pages before the next turn (published via Redis).
        n = pages_seen(routers[0], home)
        for r in routers:
            wait_until(lambda r=r: pages_seen(r, home) >= max(n, 1), "the worker's pages reach both routers")

    # Redis killed -9 mid-run: routers fall back to least load; no request fails.
    loads = [metric(r.port, "gcache_router_sync_full_loads_total") for r in routers]
    redis.kill9()
    for i in range(4):
        status, body, headers = post_json(
            routers[i % 2].port, "/v1/completions", {"prompt": f"while Redis is down {i}", "max_tokens": 2}
        )
        assert status == 200 and headers["x-gcache-worker"] in by_url, body
    # Redis back on the same port, EMPTY, while the workers' link to it is cut: the routers
    # read no registration at all (the gap every restart has until the publishers resync).
    # They keep routing to the workers they knew, by local least load; no request fails.
    gate.shut()
    refreshes = [metric(r.port, "gcache_router_refresh_ok_total") for r in routers]
    fallback = 'gcache_router_picks_total{mode="fallback"}'
    picks = [metric(r.port, fallback) for r in routers]
    redis.start()
    for r, n in zip(routers, refreshes):  # the 2nd good refresh surely read the new, empty Redis
        wait_until(lambda r=r, n=n: metric(r.port, "gcache_router_refresh_ok_total") >= n + 2, "router reads Redis")
        h = health(r)
        assert h["redis"] == "resync" and [w["url"] for w in h["workers"]] == sorted(by_url)
        assert not any(w["registered"] for w in h["workers"])
    for i in range(6):
        status, body, headers = post_json(
            routers[i % 2].port, "/v1/completions", {"prompt": f"while the workers re-register {i}", "max_tokens": 2}
        )
        assert status == 200 and headers["x-gcache-worker"] in by_url, body
    for r, n in zip(routers, picks):
        assert metric(r.port, fallback) >= n + 3
    gate.open()  # the workers re-register (new epochs), the routers reload both
    for r, n in zip(routers, loads):
        wait_until(
            lambda r=r, n=n: (
                metric(r.port, "gcache_router_sync_full_loads_total") >= n + 2
                and health(r)["redis"] == "up"
                and len(health(r)["workers"]) == 2
            ),
            "resync after Redis",
        )

    # The home worker is killed: requests are answered by the other one, and it leaves routing.
    other = next(u for u in by_url if u != home)
    by_url[home].kill()
    for i in range(3):
        status, body, headers = post_json(routers[i % 2].port, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 200 and headers["x-gcache-worker"] == other, body
    for r in routers:
        wait_until(lambda r=r: [w["url"] for w in health(r)["workers"]] == [other], "dead worker dropped")
