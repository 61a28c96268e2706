"""Router settings and their command-line flags."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, fields

from gcache.serving.redis_layout import valid_worker_url


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


@dataclass(frozen=True)
class RouterConfig:
    redis_url: str = ""  # "" = no Redis: route over the static workers only
    redis_prefix: str = "gcache:router"
    policy: str = RouterPolicy.CACHE_AWARE  # a RouterPolicy (or its string)
    match_weight: float = 2.0  # the seed's matchWeight
    load_norm_min: float = 0.0  # cache_aware: normalised load = load / max(max load, this)
    tier_weights: tuple[float, float, float] = (1.0, 0.8, 0.5)  # credit per matched token: L1, L2, L3
    balance_abs_threshold: float = 8.0  # imbalance guard (sgl-router's rule), in load units
    balance_rel_threshold: float = 1.5
    load_tokens_per_request: int = 2048  # queued uncached tokens worth one request of load
    workers: tuple[str, ...] = ()  # static list (otherwise discovered from Redis)
    refresh_interval_s: float = 0.1  # background refresh period; 0 = no thread (call refresh())
    redis_timeout_s: float = 0.5  # every Redis call (connect and read)
    redis_stale_s: float = 1.0  # no good refresh for this long -> least load, local view
    worker_grace_s: float = 2.0  # registration missing this long -> worker dropped
    backoff_base_s: float = 0.5  # after a failed request (5xx / connection error)
    backoff_max_s: float = 10.0
    dynamo_overlap_weight: float = 1.0  # Dynamo's overlap_score_weight
    dynamo_host_weight: float = 0.75  # Dynamo's host-tier hit credit
    recent_ttl_s: float = 5.0  # cache_aware: credit prompt ends just sent (0 = off)
    recent_max: int = 4096  # ... at most this many per worker
    # cache_ttft: estimated time to first token in prompt-token units (see policies.CacheTTFT)
    ttft_running_tokens: float = 16.0  # queueing cost of one running request, in prompt tokens
    ttft_own_weight: float = 1.0  # weight of the request's own uncached tokens
    ttft_unpublished_max: int = 64  # per worker: estimates kept for requests not yet published
    # approx_tree = sgl-router's cache_aware with the defaults its launcher uses
    # (sglang_router router_args.py: cache_threshold 0.3, balance_abs_threshold 64,
    # balance_rel_threshold 1.5; its guard is on the router's in-flight counts).
    approx_cache_threshold: float = 0.3
    approx_balance_abs_threshold: float = 64.0
    approx_balance_rel_threshold: float = 1.5
    approx_max_pages: int = 1 << 20  # sgl-router-style tree size cap, pages per worker
    page_size: int = 16  # hashing when no worker published its geometry
    seed: int = 0  # the random policy
    workers_max: int = 1024
    stream_read_max: int = 2000  # stream entries read per worker per refresh
    l3_pages_max: int = 1 << 20
    roles: tuple[str, ...] = ()  # registered workers of these roles only (PD pools); () = every role
    # vLLM servers (gcache.router.engines): the model's own tokenizer, by served model name
    # ("" = the default, also for workers that registered nothing), a model directory each
    tokenizers: tuple[tuple[str, str], ...] = ()
    length_buckets: tuple[int, ...] = ()  # prompt-length group bounds, ascending (tokens); () = one group
    image_weight: float = 1.0  # cache_aware: score bonus of the worker a request's first image maps to

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


def add_router_args(ap: argparse.ArgumentParser) -> None:
    """The routing flags (the HTTP front adds --host/--port and its own)."""
    d = RouterConfig.__dataclass_fields__
    g = ap.add_argument_group("routing")
    g.add_argument(
        "--redis",
        dest="redis_url",
        default="",
        metavar="redis://HOST:PORT/DB",
        help="shared state: workers publish their cache and load here",
    )
    g.add_argument("--redis-prefix", default=d["redis_prefix"].default, help="namespace of every Redis key")
    g.add_argument("--policy", choices=POLICIES, default=d["policy"].default)
    g.add_argument(
        "--match-weight",
        type=float,
        default=d["match_weight"].default,
        help="cache_aware: score = match_weight * window-safe match %% - normalised load",
    )
    g.add_argument(
        "--load-norm-min",
        type=float,
        default=d["load_norm_min"].default,
        help="cache_aware: normalised load = load / max(highest candidate load, this), so a "
        "one-request difference between lightly loaded workers does not outweigh a match",
    )
    g.add_argument(
        "--tier-weights",
        default="1.0,0.8,0.5",
        metavar="L1,L2,L3",
        help="cache_aware: credit per matched token held in L1 / L2 / L3",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=float,
        default=d["balance_abs_threshold"].default,
        help="route by load when max - min load exceeds this ...",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=d["balance_rel_threshold"].default,
        help="... and max load exceeds min load times this",
    )
    g.add_argument(
        "--load-tokens-per-request",
        type=int,
        default=d["load_tokens_per_request"].default,
        help="queued uncached prompt tokens counted as one request of load",
    )
    g.add_argument(
        "--workers",
        default="",
        metavar="URL,...",
        help="static worker list (default: every worker registered in Redis)",
    )
    g.add_argument("--refresh-interval-s", type=float, default=d["refresh_interval_s"].default)
    g.add_argument("--redis-timeout-s", type=float, default=d["redis_timeout_s"].default)
    g.add_argument(
        "--redis-stale-s",
        type=float,
        default=d["redis_stale_s"].default,
        help="without a good Redis refresh for this long, route by local least load",
    )
    g.add_argument("--worker-grace-s", type=float, default=d["worker_grace_s"].default)
    g.add_argument("--backoff-base-s", type=float, default=d["backoff_base_s"].default)
    g.add_argument("--backoff-max-s", type=float, default=d["backoff_max_s"].default)
    g.add_argument("--dynamo-overlap-weight", type=float, default=d["dynamo_overlap_weight"].default)
    g.add_argument("--dynamo-host-weight", type=float, default=d["dynamo_host_weight"].default)
    g.add_argument(
        "--recent-ttl-s",
        type=float,
        default=d["recent_ttl_s"].default,
        help="cache_aware: until a worker publishes it, a prompt just sent there counts as "
        "cached at its end for this long (0 = off)",
    )
    g.add_argument("--approx-cache-threshold", type=float, default=d["approx_cache_threshold"].default)
    g.add_argument("--approx-balance-abs-threshold", type=float, default=d["approx_balance_abs_threshold"].default)
    g.add_argument("--approx-balance-rel-threshold", type=float, default=d["approx_balance_rel_threshold"].default)
    g.add_argument(
        "--ttft-running-tokens",
        type=float,
        default=d["ttft_running_tokens"].default,
        help="cache_ttft: queueing cost of one running request, in prompt tokens",
    )
    g.add_argument(
        "--ttft-own-weight",
        type=float,
        default=d["ttft_own_weight"].default,
        help="cache_ttft: weight of the request's own uncached tokens (> 1: also its cost to others)",
    )
    g.add_argument("--ttft-unpublished-max", type=int, default=d["ttft_unpublished_max"].default)
    g.add_argument("--approx-max-pages", type=int, default=d["approx_max_pages"].default)
    g.add_argument(
        "--page-size",
        type=int,
        default=d["page_size"].default,
        help="page size for hashing prompts when no worker published one",
    )
    g.add_argument("--seed", type=int, default=d["seed"].default, help="the random policy's seed")
    g.add_argument(
        "--tokenizer",
        dest="tokenizers",
        action="append",
        metavar="[MODEL=]DIR",
        help="vLLM servers: the model directory whose tokenizer and chat template they use (the "
        "router tokenizes prompts as they do); MODEL=DIR for the servers of that served model name; "
        "repeatable",
    )
    g.add_argument(
        "--length-buckets",
        metavar="BOUNDS",
        help="split the workers into prompt-length groups, e.g. 64K,256K or 0-64K,64K-256K,256K-1M: "
        "a prompt goes to its group only; affinity and load apply within it",
    )
    g.add_argument(
        "--image-weight",
        type=float,
        default=d["image_weight"].default,
        help="cache_aware: score bonus of the worker a request's first image hashes to (0 = off)",
    )
