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
