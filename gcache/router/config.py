"""Router settings and their command-line flags."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field, fields

from gcache.common.flags import add_flags, flag
from gcache.serving.redis_layout import DEFAULT_PREFIX, valid_worker_url


class RouterPolicy(enum.StrEnum):
    """The routing policies by the names --policy takes (gcache.router.policies)."""

    CACHE_AWARE = "cache_aware"
    CACHE_TTFT = "cache_ttft"
    LEAST_LOAD = "least_load"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    DYNAMO = "dynamo"
    APPROX_TREE = "approx_tree"


POLICIES = tuple(p.value for p in RouterPolicy)


def _joined(values: tuple[object, ...]) -> str:
    """A tuple field's flag: its items comma-separated (RouterConfig.from_args splits them)."""
    return ",".join(str(v) for v in values)


ROUTING = "routing"  # gcache-router's argument group of these flags


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings; the flags of the ones it exposes are made from their fields
    (gcache.common.flags, add_router_args), the others are ROUTER_NOT_FLAGS."""

    redis_url: str = field(  # "" = no Redis: route over the static workers only
        default="",
        metadata=flag(
            "shared state: workers publish their cache and load here",
            name="--redis",
            metavar="redis://HOST:PORT/DB",
            group=ROUTING,
        ),
    )
    redis_prefix: str = field(default=DEFAULT_PREFIX, metadata=flag("namespace of every Redis key", group=ROUTING))
    policy: str = field(  # a RouterPolicy (or its string)
        default=RouterPolicy.CACHE_AWARE, metadata=flag(choices=POLICIES, group=ROUTING)
    )
    match_weight: float = field(  # the seed's matchWeight
        default=2.0,
        metadata=flag("cache_aware: score = match_weight * window-safe match %% - normalised load", group=ROUTING),
    )
    load_norm_min: float = field(  # cache_aware: normalised load = load / max(max load, this)
        default=0.0,
        metadata=flag(
            "cache_aware: normalised load = load / max(highest candidate load, this), so a "
            "one-request difference between lightly loaded workers does not outweigh a match",
            group=ROUTING,
        ),
    )
    tier_weights: tuple[float, float, float] = field(  # credit per matched token: L1, L2, L3
        default=(1.0, 0.8, 0.5),
        metadata=flag(
            "cache_aware: credit per matched token held in L1 / L2 / L3",
            metavar="L1,L2,L3",
            group=ROUTING,
            text=True,
            from_field=_joined,
        ),
    )
    balance_abs_threshold: float = field(  # imbalance guard (sgl-router's rule), in load units
        default=8.0, metadata=flag("route by load when max - min load exceeds this ...", group=ROUTING)
    )
    balance_rel_threshold: float = field(
        default=1.5, metadata=flag("... and max load exceeds min load times this", group=ROUTING)
    )
    load_tokens_per_request: int = field(  # queued uncached tokens worth one request of load
        default=2048, metadata=flag("queued uncached prompt tokens counted as one request of load", group=ROUTING)
    )
    workers: tuple[str, ...] = field(  # static list (otherwise discovered from Redis)
        default=(),
        metadata=flag(
            "static worker list (default: every worker registered in Redis)",
            metavar="URL,...",
            group=ROUTING,
            text=True,
            from_field=_joined,
        ),
    )
    refresh_interval_s: float = field(  # background refresh period; 0 = no thread (call refresh())
        default=0.1, metadata=flag(group=ROUTING)
    )
    redis_timeout_s: float = field(default=0.5, metadata=flag(group=ROUTING))  # every Redis call (connect and read)
    redis_stale_s: float = field(  # no good refresh for this long -> least load, local view
        default=1.0,
        metadata=flag("without a good Redis refresh for this long, route by local least load", group=ROUTING),
    )
    worker_grace_s: float = field(  # registration missing this long -> worker dropped
        default=2.0, metadata=flag(group=ROUTING)
    )
    backoff_base_s: float = field(  # after a failed request (5xx / connection error)
        default=0.5, metadata=flag(group=ROUTING)
    )
    backoff_max_s: float = field(default=10.0, metadata=flag(group=ROUTING))
    dynamo_overlap_weight: float = field(default=1.0, metadata=flag(group=ROUTING))  # Dynamo's overlap_score_weight
    dynamo_host_weight: float = field(default=0.75, metadata=flag(group=ROUTING))  # Dynamo's host-tier hit credit
    recent_ttl_s: float = field(  # cache_aware: credit prompt ends just sent (0 = off)
        default=5.0,
        metadata=flag(
            "cache_aware: until a worker publishes it, a prompt just sent there counts as "
            "cached at its end for this long (0 = off)",
            group=ROUTING,
        ),
    )
    recent_max: int = 4096  # ... at most this many per worker
    # approx_tree = sgl-router's cache_aware with the defaults its launcher uses
    # (sglang_router router_args.py: cache_threshold 0.3, balance_abs_threshold 64,
    # balance_rel_threshold 1.5; its guard is on the router's in-flight counts).
    approx_cache_threshold: float = field(default=0.3, metadata=flag(group=ROUTING))
    approx_balance_abs_threshold: float = field(default=64.0, metadata=flag(group=ROUTING))
    approx_balance_rel_threshold: float = field(default=1.5, metadata=flag(group=ROUTING))
    # cache_ttft: estimated time to first token in prompt-token units (see policies.CacheTTFT)
    ttft_running_tokens: float = field(  # queueing cost of one running request, in prompt tokens
        default=16.0,
        metadata=flag("cache_ttft: queueing cost of one running request, in prompt tokens", group=ROUTING),
    )
    ttft_own_weight: float = field(  # weight of the request's own uncached tokens
        default=1.0,
        metadata=flag(
            "cache_ttft: weight of the request's own uncached tokens (> 1: also its cost to others)", group=ROUTING
        ),
    )
    ttft_unpublished_max: int = field(  # per worker: estimates kept for requests not yet published
        default=64, metadata=flag(group=ROUTING)
    )
    approx_max_pages: int = field(  # sgl-router-style tree size cap, pages per worker
        default=1 << 20, metadata=flag(group=ROUTING)
    )
    page_size: int = field(  # hashing when no worker published its geometry
        default=16, metadata=flag("page size for hashing prompts when no worker published one", group=ROUTING)
    )
    seed: int = field(default=0, metadata=flag("the random policy's seed", group=ROUTING))  # the random policy
    workers_max: int = 1024
    stream_read_max: int = 2000  # stream entries read per worker per refresh
    l3_pages_max: int = 1 << 20
    roles: tuple[str, ...] = ()  # registered workers of these roles only (PD pools); () = every role
    # vLLM servers (gcache.serving.announce.engines): the model's own tokenizer, by served model name
    # ("" = the default, also for workers that registered nothing), a model directory each
    tokenizers: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=flag(
            "vLLM servers: the model directory whose tokenizer and chat template they use (the "
            "router tokenizes prompts as they do); MODEL=DIR for the servers of that served model name; "
            "repeatable",
            name="--tokenizer",
            action="append",
            metavar="[MODEL=]DIR",
            group=ROUTING,
            default=None,
        ),
    )
    length_buckets: tuple[int, ...] = field(  # prompt-length group bounds, ascending (tokens); () = one group
        default=(),
        metadata=flag(
            "split the workers into prompt-length groups, e.g. 64K,256K or 0-64K,64K-256K,256K-1M: "
            "a prompt goes to its group only; affinity and load apply within it",
            metavar="BOUNDS",
            group=ROUTING,
            text=True,
            default=None,
        ),
    )
    image_weight: float = field(
        default=1.0,
        metadata=flag(
            "cache_aware: score bonus of the worker a request's first image hashes to (0 = off)", group=ROUTING
        ),
    )

    @property
    def tokenizer_names(self) -> frozenset:
        return frozenset(name for name, _ in self.tokenizers)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "unix://", "rediss://")):
            raise ValueError(f"--redis must look like redis://HOST:PORT/DB, got {self.redis_url!r}")
        if not self.redis_url and not self.workers:
            raise ValueError("give --redis (workers discovered from Redis) or --workers URL,...")
        if len(self.tier_weights) != 3 or any(not 0 <= w <= 10 for w in self.tier_weights):
            raise ValueError("tier_weights must be three numbers in [0, 10] (L1, L2, L3)")
        for name in (
            "match_weight",
            "balance_abs_threshold",
            "dynamo_overlap_weight",
            "dynamo_host_weight",
            "approx_balance_abs_threshold",
            "ttft_running_tokens",
            "load_norm_min",
            "ttft_own_weight",
            "image_weight",
        ):
            if not 0 <= getattr(self, name) <= 1e6:
                raise ValueError(f"{name} must be in [0, 1e6]")
        for name in ("balance_rel_threshold", "approx_balance_rel_threshold"):
            if not 1.0 <= getattr(self, name) <= 1e6:
                raise ValueError(f"{name} must be in [1, 1e6]")
        if not 0 <= self.approx_cache_threshold <= 1:
            raise ValueError("approx_cache_threshold must be in [0, 1]")
        for name in ("redis_timeout_s", "redis_stale_s", "worker_grace_s", "backoff_base_s", "backoff_max_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600]")
        if not 0 <= self.refresh_interval_s <= 60:
            raise ValueError("refresh_interval_s must be in [0, 60]")
        if not 0 <= self.recent_ttl_s <= 3600:
            raise ValueError("recent_ttl_s must be in [0, 3600]")
        for name in (
            "load_tokens_per_request",
            "approx_max_pages",
            "recent_max",
            "page_size",
            "workers_max",
            "ttft_unpublished_max",
            "stream_read_max",
            "l3_pages_max",
        ):
            if not 1 <= getattr(self, name) <= 1 << 30:
                raise ValueError(f"{name} must be in [1, 2^30]")
        workers = tuple(u.rstrip("/") for u in self.workers)
        bad = [u for u in workers if not valid_worker_url(u)]
        if bad:
            raise ValueError(
                f"worker URLs must be http(s)://HOST:PORT (printable, no spaces or quotes), got {bad[0][:200]!r}"
            )
        if len(workers) > self.workers_max:
            raise ValueError(f"at most workers_max={self.workers_max} static workers, got {len(workers)}")
        object.__setattr__(self, "workers", workers)
        b = tuple(self.length_buckets)
        if len(b) > 63 or any(not isinstance(x, int) or x < 1 for x in b) or list(b) != sorted(set(b)):
            raise ValueError("length_buckets must be at most 63 ascending token counts >= 1 (the groups' bounds)")
        object.__setattr__(self, "length_buckets", b)
        names = [n for n, _ in self.tokenizers]
        if len(names) != len(set(names)) or any(not d for _, d in self.tokenizers):
            raise ValueError("--tokenizer: one directory per model name (and at most one without a name)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in vars(args).items() if k in names and v is not None}
        if isinstance(kw.get("workers"), str):
            kw["workers"] = tuple(u.strip() for u in kw["workers"].split(",") if u.strip())
        if isinstance(kw.get("length_buckets"), str):
            kw["length_buckets"] = parse_length_buckets(kw["length_buckets"])
        if isinstance(kw.get("tokenizers"), list):
            kw["tokenizers"] = tuple(parse_tokenizer_arg(a) for a in kw["tokenizers"])
        if isinstance(kw.get("tier_weights"), str):
            try:
                kw["tier_weights"] = tuple(float(x) for x in kw["tier_weights"].split(","))
            except ValueError:
                raise ValueError(f"--tier-weights must be three numbers L1,L2,L3, got {kw['tier_weights']!r}") from None
        return cls(**kw)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}


def _count(text: str) -> int:
    t = text.strip().lower()
    unit = t[-1] if t and t[-1] in "km" else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"--length-buckets: {text!r} is not a token count (like 65536 or 64K)") from None


def parse_length_buckets(text: str) -> tuple[int, ...]:
    """'64K,256K' or the report's '0-64K,64K-256K,256K-1M' -> (65536, 262144): the bounds
    between groups (the last group is open-ended)."""
    items = [x for x in text.split(",") if x.strip()]
    if items and all("-" in x for x in items):  # ranges: their upper ends, bar the last
        return tuple(_count(x.split("-", 1)[1]) for x in items[:-1])
    return tuple(_count(x) for x in items)


def parse_tokenizer_arg(text: str) -> tuple[str, str]:
    """'DIR' (the default) or 'MODEL=DIR'."""
    name, sep, path = text.partition("=")
    return (name.strip(), path.strip()) if sep else ("", text.strip())


# RouterConfig's fields that are no gcache-router flag (tuning kept at its defaults; roles: the
# PD router's pools, gcache.router.pd_config)
ROUTER_NOT_FLAGS = ("recent_max", "workers_max", "stream_read_max", "l3_pages_max", "roles")


def add_router_args(ap: argparse.ArgumentParser) -> None:
    """The routing flags (the HTTP front adds --host/--port and its own), from RouterConfig's fields."""
    add_flags(ap, RouterConfig, not_flags=ROUTER_NOT_FLAGS)
