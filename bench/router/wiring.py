"""The real router parts, driven synchronously in virtual time (router_api.md, "Driving it
in-process"): gcache.worker.http.publisher.WorkerPublisher per worker, gcache.router.RouterCore
per router, both on the simulation's clock and without background threads."""

from __future__ import annotations

from gcache.router.config import RouterConfig
from gcache.router.core import RouterCore
from gcache.worker.http.publisher import PublisherConfig, WorkerPublisher

PREFIX = "bench:router"
TTL_S = 3600.0  # Redis TTLs are wall time; the simulation's ticks are virtual


class Publisher:
    def __init__(self, redis_url: str, url: str, engine, clock) -> None:
        cfg = PublisherConfig(redis_url, url, prefix=PREFIX, interval_s=0, ttl_s=TTL_S, redis_timeout_s=5.0)
        self.pub = WorkerPublisher(engine, cfg, start_thread=False, clock=clock)

    def on_step(self, engine) -> None:
        self.pub.on_step(engine)

    def flush(self) -> None:
        if not self.pub.flush():
            raise RuntimeError(f"publisher flush failed: {self.pub.stats()}")

    def close(self) -> None:
        self.pub.stop(deregister=False)


class Router:
    def __init__(self, redis_url: str, policy: str, clock, seed: int, **knobs) -> None:
        cfg = RouterConfig(
            redis_url=redis_url,
            redis_prefix=PREFIX,
            policy=policy,
            refresh_interval_s=0,
            redis_timeout_s=5.0,
            seed=seed,
            **knobs,
        )
        self.config = cfg
        self.core = RouterCore(cfg, clock=clock)

    def refresh(self) -> None:
        if not self.core.refresh():
            raise RuntimeError("router refresh: Redis did not answer")

    def pick(self, tokens, exclude=frozenset()):
        return self.core.pick([int(t) for t in tokens], exclude=exclude)

    def explain(self, tokens) -> dict:
        return self.core.explain([int(t) for t in tokens])

    def begin(self, url: str, tokens: int = 0) -> None:
        self.core.begin(url, tokens)

    def end(self, url: str, ok: bool, tokens: int = 0) -> None:
        self.core.end(url, ok, tokens)

    def close(self) -> None:
        self.core.close()


class Wiring:
    """Builds the real parts; `knobs` go into every RouterConfig (e.g. match_weight)."""

    def __init__(self, **knobs) -> None:
        self.knobs = knobs

    def describe(self) -> str:
        c = RouterConfig(redis_url="redis://127.0.0.1:1/0", **self.knobs)
        return (
            f"cache_aware: match_weight {c.match_weight}, load / max(max load, {c.load_norm_min}), "
            f"tier weights L1/L2/L3 {c.tier_weights}, "
            f"imbalance guard abs {c.balance_abs_threshold} and rel {c.balance_rel_threshold}; "
            f"dynamo: overlap weight {c.dynamo_overlap_weight}, host weight {c.dynamo_host_weight}; "
            f"cache_ttft: running request = {c.ttft_running_tokens} prompt tokens, own weight "
            f"{c.ttft_own_weight}; approx_tree (sgl-router launcher defaults): cache threshold "
            f"{c.approx_cache_threshold}, guard abs {c.approx_balance_abs_threshold} and rel "
            f"{c.approx_balance_rel_threshold} on in-flight; load = running + "
            f"waiting (or this router's in-flight) + queued tokens / {c.load_tokens_per_request}"
        )

    def publisher(self, redis_url: str, url: str, engine, clock) -> Publisher:
        return Publisher(redis_url, url, engine, clock)

    def router(self, redis_url: str, policy: str, clock, seed: int = 0) -> Router:
        return Router(redis_url, policy, clock, seed, **self.knobs)
