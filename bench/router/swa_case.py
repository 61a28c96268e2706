"""The SWA mis-routing case of bench/router/policies.py, built step by step on two real engines.

Worker A computed a document D, a question q0 and a long continuation s in one request; as
the request moved on, the SWA KV of every page that left the window was evicted under memory
pressure (the spare out-of-window pages go first; only the window tail of the request's end is
kept, as SWA-aware servers do), while the full-attention
KV of every page stayed in A's tree. Worker B computed D alone (its end is a checkpoint).
A new request D + q0 + q2 arrives:
  * A holds D+q0 in full KV but can resume nowhere in it (no live SWA window tail before
    the branch point): its window-safe match is 0 tokens; B can resume at the end of D.
  * SWA-unaware scorers see A's pages (Dynamo-style: the full pages A published) or what
    they sent A (sgl-router-style approximate tree), credit A with the longer match, route
    there, and A recomputes the whole prompt.
  * cache_aware scores the window-safe match per worker and routes to B.
L1 only (no L2/L3), so the case isolates the device tree. The placement steps go through each policy's own router with
pick(exclude=other worker), so the approximate tree learns them too; Redis is real, the
publishers flush and the routers refresh after every step.
"""

from __future__ import annotations

import numpy as np

from bench.hicache.cluster import Budgets, Setup, Worker
from bench.router.sim import Cluster, SimConfig
from gcache.common.attention import AttentionKind
from gcache.tools.devcluster.local_redis import LocalRedis
from gcache.wire.keys import page_hashes_array
from gcache.worker.config import ModelConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.kvcache.kv_pool import DualKVCache

FULL_PAGES, SWA_PAGES = 1024, 256
DOC_TOKENS, Q_TOKENS, CONTINUATION_TOKENS = 1024, 96, 512
POLICIES = ("round_robin", "least_load", "approx_tree", "dynamo", "cache_aware", "cache_ttft")


def _tokens(rng, n: int) -> np.ndarray:
    return rng.integers(0, 4096, n).astype(np.int64)


def _run(cluster: Cluster, router, k: int, prompt: np.ndarray, max_tokens: int, forced: bool) -> object:
    """Route (forced to worker k, or freely when k < 0), run to completion, publish, refresh.
    Returns the finished request and the worker index it ran on."""
    urls = cluster.urls
    exclude = frozenset(u for j, u in enumerate(urls) if j != k) if forced else frozenset()
    url = router.pick(prompt, exclude=exclude)
    if url is None or (forced and url != urls[k]):
        raise RuntimeError(f"forced pick to {urls[k]} returned {url!r}")
    k = urls.index(url)
    w = cluster.workers[k]
    router.begin(url, len(prompt))
    arrival = max(x.clock() for x in cluster.workers)
    w.clock.advance_to(arrival)
    r = w.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    r.arrival_s = arrival
    for _ in range(100_000):
        if r.is_finished:
            break
        w.step()
        cluster.publishers[k].on_step(w.engine)
    else:
        raise RuntimeError("request did not finish")
    router.end(url, True, len(prompt))
    cluster.time.advance_to(w.clock())
    cluster.flush()
    cluster.refresh()
    w.engine.check_integrity()
    return r, k


def _case_for(policy: str, st: dict, redis_url: str) -> dict:
    import redis

    with redis.Redis.from_url(redis_url) as c:
        c.flushdb()
    cfg = ModelConfig(dtype="float32")
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    budgets = Budgets(FULL_PAGES * bf + SWA_PAGES * bs, 0, 0, l1_swa_full_ratio=SWA_PAGES / FULL_PAGES)
    workers = [Worker(cfg, Setup("L1"), budgets, st["sched"], st["cost"], st["timing"], "", 64) for _ in range(2)]
    cluster = Cluster(workers, st["wiring"], redis_url, policy, SimConfig(), cfg.page_size, cfg.window)
    router = cluster.routers[0]
    try:
        rng = np.random.default_rng(7)
        doc, q0, q2 = _tokens(rng, DOC_TOKENS), _tokens(rng, Q_TOKENS), _tokens(rng, Q_TOKENS)
        cont = _tokens(rng, CONTINUATION_TOKENS)
        _run(cluster, router, 0, np.concatenate([doc, q0, cont]), 1, forced=True)  # A: D + q0 + s
        # A's pool is needed elsewhere: the out-of-window SWA pages it kept as spare go (they
        # are evicted first under pressure); only the checkpoints' window tails stay.
        tree = workers[0].engine.tree
        tree.evict(0, tree.spare_pages())
        cluster.publishers[0].on_step(workers[0].engine)
        cluster.flush()
        cluster.refresh()
        _run(cluster, router, 1, doc, 1, forced=True)  # B: D
        probe = np.concatenate([doc, q0, q2])
        keys = page_hashes_array(probe[: len(probe) // cfg.page_size * cfg.page_size], cfg.page_size)
        held = [cluster.probe(w.cache, probe, keys) for w in workers]  # (window-safe, full present)
        credited = {}
        try:
            credited = {u.rsplit("-", 1)[-1].split(":")[0]: v for u, v in router.explain(probe).items()}
        except Exception as e:  # explain is a diagnostic; the case stands without it
            credited = {"error": repr(e)}
        r, k = _run(cluster, router, -1, probe, 8, forced=False)
        return {
            "policy": policy,
            "picked": "AB"[k],
            "held": held,
            "cached": r.cached_tokens,
            "prompt": len(probe),
            "ttft_s": r.ttft_s,
            "credited": credited,
        }
    finally:
        cluster.close()


def run_swa_case(st: dict) -> dict:
    srv = LocalRedis()
    try:
        rows = [_case_for(p, st, f"redis://{srv.address}/0") for p in POLICIES if p in st.get("policies", POLICIES)]
    finally:
        srv.stop()
    held = rows[0]["held"]
    print(
        f"\n=== SWA mis-routing case (2 workers, L1 only: {FULL_PAGES} full + {SWA_PAGES} SWA pages each; W=128): "
        f"A computed D+q0+s ({DOC_TOKENS}+{Q_TOKENS}+{CONTINUATION_TOKENS} tokens; the SWA KV of pages that "
        f"left the window was evicted, the full KV stayed), B computed D. "
        f"Request D+q0+q2 ({rows[0]['prompt']} tokens):"
    )
    print(
        f"  held before the request (window-safe / full-KV prefix tokens): A {held[0][0]} / {held[0][1]}, "
        f"B {held[1][0]} / {held[1][1]}"
    )
    print(
        f"  {'policy':<12} {'picked':>6} {'cached':>7} {'recomputed':>10} {'TTFT':>8}   credited by the policy (A | B)"
    )
    for row in rows:
        cred = row["credited"]
        text = (
            " | ".join(_credit_text(cred.get(str(j), {})) for j in range(2)) if "error" not in cred else cred["error"]
        )
        print(
            f"  {row['policy']:<12} {row['picked']:>6} {row['cached']:>7} {row['prompt'] - row['cached']:>10} "
            f"{row['ttft_s']:>7.3f}s   {text}"
        )
    by = {row["policy"]: row for row in rows}
    ours = by.get("cache_aware")
    unaware = [by[p] for p in ("approx_tree", "dynamo") if p in by]
    aware = [by[p] for p in ("cache_aware", "cache_ttft") if p in by]
    met = bool(
        ours
        and held[0][1] > held[0][0]
        and all(a["picked"] == "B" for a in aware)
        and all(u["picked"] == "A" and u["cached"] < ours["cached"] for u in unaware)
    )
    summary = (
        f"A held {held[0][1]} full-KV tokens but {held[0][0]} window-safe; "
        + ", ".join(f"{u['policy']} -> {u['picked']} (cached {u['cached']}, TTFT {u['ttft_s']:.3f}s)" for u in unaware)
        + "".join(f"; {a['policy']} -> {a['picked']} (cached {a['cached']}, TTFT {a['ttft_s']:.3f}s)" for a in aware)
    )
    return {"rows": rows, "held": held, "met": met, "summary": summary}


def _credit_text(c: dict) -> str:
    if not c:
        return "-"
    parts = [
        f"{k}={c[k]:.3g}" if isinstance(c[k], float) else f"{k}={c[k]}"
        for k in ("match", "raw_overlap", "load", "score")
        if k in c
    ]
    return " ".join(parts)
