"""gcache-router's PD flags and the two pools' configs (no processes)."""

from __future__ import annotations

import argparse

import pytest

from gcache.router.config import RouterConfig
from gcache.router.pd_config import PDConfig, add_pd_args, pd_config


def pd_args(*argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", dest="redis_url", default="")
    add_pd_args(ap)
    return ap.parse_args(list(argv))


def test_router_pd_pools():
    assert pd_config(pd_args()) is None
    pd = pd_config(pd_args("--prefill-workers", "http://a:1", "--decode-workers", "http://b:2"))
    base = RouterConfig(workers=("http://a:1", "http://b:2"))
    pre, dec = pd.pools(base)
    assert pre.workers == ("http://a:1",) and dec.workers == ("http://b:2",) and dec.policy == "least_load"
    pre, dec = pd_config(pd_args("--pd", "--redis", "redis://r:1/0")).pools(RouterConfig(redis_url="redis://r:1/0"))
    assert (pre.roles, dec.roles) == (("prefill",), ("decode",)) and pre.policy == "cache_aware"
    with pytest.raises(ValueError, match="--redis"):
        pd_config(pd_args("--pd"))
    with pytest.raises(ValueError, match="go together"):
        PDConfig(prefill_workers=("http://a:1",))


def test_the_decode_pick_is_least_load_among_workers_with_room():
    from gcache.router.pd_policy import DecodeLoad
    from gcache.router.policies import Candidate, Prompt
    from gcache.serving.redis_layout import Registration, WorkerLoad

    def cand(url, running, free, rank=0):
        reg = Registration(url, "m", 8, 32, "e", 1, 0, WorkerLoad(running, 0, 0, 0, 32, free))
        return Candidate(url, rank, 0, 0, reg, {})

    policy = DecodeLoad(RouterConfig(workers=("http://a:1",)))
    p = Prompt(800, lambda ps: [], {}, 8)  # 800 tokens + 1: 101 pages
    assert policy.choose(p, [cand("http://a", 0, 100), cand("http://b", 3, 101)]).url == "http://b"
    assert policy.choose(p, [cand("http://a", 0, 500), cand("http://b", 3, 101)]).url == "http://a"
    assert policy.choose(p, [cand("http://a", 2, 5), cand("http://b", 1, 7)]).url == "http://b"  # none has room
    unpublished = Candidate("http://c", 0, 4, 0, None, {})  # static worker: room assumed, in-flight as load
    assert policy.choose(p, [cand("http://a", 5, 50), unpublished]).url == "http://c"
