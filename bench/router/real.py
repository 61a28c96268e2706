"""bench/router/policies.py --real: real processes over real sockets, TTFT and hit rate as a client sees them.

Per policy (fresh processes each, so every policy starts from empty caches): one redis-server,
3 gcache-worker processes (the real numpy model; each publishes its cache and load to Redis)
and 2 gcache-router processes (--redis, --policy P). A client runs --real-conversations chat
conversations at once; each sends --real-turns turns in sequence through the OpenAI
/v1/chat/completions API with stream=true, alternating between the two routers (turn t goes
to router t % 2), and appends the answer it received to its history, as a chat front end does.
Measured per request: TTFT = time to the first streamed chunk carrying content (the role chunk
that opens a chat stream does not count), usage.prompt_tokens_details.cached_tokens from the
final chunk, and the worker that answered (x-gcache-worker).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common.processes import Proc
from gcache.common.processes import free_port
from gcache.tools.storebench.peers.redis_peer import LocalRedis

START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
WORKERS, ROUTERS = 3, 2


def entry_points_missing() -> str:
    """'' when gcache-router and the worker's Redis publishing are importable, else why not."""
    for mod in ("gcache.router.main", "gcache.worker.http.publisher"):
        try:
            __import__(mod)
        except ImportError as e:
            return f"{mod} is not importable ({e})"
    return ""


def _conversations(seed: int, n: int, turns: int) -> list[list[str]]:
    """Per conversation: a system prompt shared by every other conversation (one of 2), then
    `turns` user messages (printable ASCII, so the byte tokenizer maps 1 char = 1 token)."""
    rng = np.random.default_rng(seed)
    text = lambda k: "".join(chr(c) for c in rng.integers(97, 123, int(k)))
    systems = [text(rng.integers(400, 700)) for _ in range(2)]
    return [[systems[i % 2]] + [text(rng.integers(60, 160)) for _ in range(turns)] for i in range(n)]


async def _one_turn(session, router_url: str, messages: list[dict], max_tokens: int) -> dict:
    import aiohttp

    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with session.post(f"{router_url}/v1/chat/completions", json=body, timeout=timeout) as resp:
        worker = resp.headers.get("x-gcache-worker", "?")
        if resp.status != 200:
            return {"error": f"{resp.status}: {(await resp.text())[:200]}", "worker": worker}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])[:200], "worker": worker}
            for ch in chunk.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None:
        return {"error": "stream ended without usage", "worker": worker}
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
        "answer": "".join(text),
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "worker": worker,
    }


async def _client(routers: list[str], convs: list[list[str]], max_tokens: int) -> list[dict]:
    import aiohttp

    async def conversation(ci: int, conv: list[str]) -> list[dict]:
        messages = [{"role": "system", "content": conv[0]}]
        out = []
        async with aiohttp.ClientSession() as session:
            for t, user in enumerate(conv[1:]):
                messages.append({"role": "user", "content": user})
                res = await _one_turn(session, routers[t % len(routers)], messages, max_tokens)
                res.update(conversation=ci, turn=t)
                out.append(res)
                if "error" in res:
                    break
                messages.append({"role": "assistant", "content": res["answer"]})
        return out

    per_conv = await asyncio.gather(*(conversation(i, c) for i, c in enumerate(convs)))
    return [r for rs in per_conv for r in rs]


def _start_cluster(policy: str, args, logdir: Path):
    redis = LocalRedis()
    procs: list[Proc] = []
    url = f"redis://{redis.address}/0"
    py = sys.executable
    try:
        for i in range(WORKERS):
            port = free_port()
            procs.append(
                Proc(
                    f"worker{i}-{policy}",
                    [
                        py,
                        "-m",
                        "gcache.worker.http.server",
                        "--port",
                        str(port),
                        "--redis",
                        url,
                        "--kv-budget-mib",
                        str(args.real_kv_mib),
                        "--l2-mib",
                        str(args.real_kv_mib),
                        "--max-new-tokens",
                        "256",
                    ],
                    port,
                    logdir,
                )
            )
        routers = []
        for i in range(ROUTERS):
            port = free_port()
            procs.append(
                Proc(
                    f"router{i}-{policy}",
                    [py, "-m", "gcache.router.main", "--port", str(port), "--redis", url, "--policy", policy],
                    port,
                    logdir,
                )
            )
            routers.append(f"http://127.0.0.1:{port}")
        for p in procs:
            p.wait_listening()
        _wait_routers_see_workers(routers, procs)
    except BaseException:
        for p in procs:
            p.stop()
        redis.stop()
        raise
    return redis, procs, routers


def _wait_routers_see_workers(routers: list[str], procs: list[Proc]) -> None:
    import urllib.request

    deadline = time.monotonic() + START_TIMEOUT_S
    for r in routers:
        while True:
            try:
                with urllib.request.urlopen(f"{r}/health", timeout=2) as resp:
                    h = json.loads(resp.read())
                if len(h.get("workers", [])) == WORKERS:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"router {r} did not see {WORKERS} workers within {START_TIMEOUT_S}s:\n"
                    + "\n".join(p.tail()[-400:] for p in procs)
                )
            time.sleep(0.1)


def run_policy(policy: str, args, convs, logdir: Path) -> dict:
    redis, procs, routers = _start_cluster(policy, args, logdir)
    try:
        t0 = time.perf_counter()
        rows = asyncio.run(_client(routers, convs, args.real_max_tokens))
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.stop()
        redis.stop()
    return summarize(policy, rows, wall)


def summarize(policy: str, rows: list[dict], wall_s: float) -> dict:
    ok = [r for r in rows if "error" not in r]
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    by_conv: dict[int, list[dict]] = {}
    for r in ok:
        by_conv.setdefault(r["conversation"], []).append(r)
    stays = moves = 0
    for rs in by_conv.values():
        rs.sort(key=lambda r: r["turn"])
        for a, b in zip(rs, rs[1:]):
            stays += a["worker"] == b["worker"]
            moves += a["worker"] != b["worker"]
    served: dict[str, int] = {}
    for r in ok:
        served[r["worker"]] = served.get(r["worker"], 0) + 1
    ttfts = [r["ttft_s"] for r in ok]
    return {
        "policy": policy,
        "requests": len(rows),
        "errors": [r["error"] for r in rows if "error" in r],
        "hit": cached / max(1, prompt),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50": float(np.percentile(ttfts, 50)) if ttfts else float("nan"),
        "ttft_p90": float(np.percentile(ttfts, 90)) if ttfts else float("nan"),
        "same_worker": stays / max(1, stays + moves),
        "served": sorted(served.values(), reverse=True),
        "wall_s": wall_s,
    }


def run_real(args) -> dict:
    missing = entry_points_missing()
    if missing:
        print(f"--real skipped: {missing}")
        return {"skipped": missing}
    if shutil.which("redis-server") is None:
        print("--real skipped: redis-server is not installed")
        return {"skipped": "redis-server is not installed"}
    policies = [p for p in args.real_policies.split(",") if p]
    convs = _conversations(args.real_seed, args.real_conversations, args.real_turns)
    print(
        f"=== real processes: {WORKERS} gcache-worker (real numpy model, --kv-budget-mib {args.real_kv_mib} "
        f"--l2-mib {args.real_kv_mib}, publishing to Redis) + {ROUTERS} gcache-router (--redis) + 1 redis-server, "
        f"fresh per policy; {len(convs)} chat conversations at once x {args.real_turns} turns, streamed "
        f"(/v1/chat/completions, stream=true), turn t through router t % {ROUTERS}; answers "
        f"{args.real_max_tokens} tokens (ignore_eos); 2 shared system prompts"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="router-real-") as tmp:
        for policy in policies:
            results.append(run_policy(policy, args, convs, Path(tmp)))
    print(
        f"  {'policy':<12} {'requests':>8} {'errors':>6} {'token hit':>9} {'TTFT P50':>9} {'TTFT P90':>9} "
        f"{'same worker':>11} {'served per worker':>18} {'wall':>6}"
    )
    base = next((r for r in results if r["policy"] == "least_load"), None)
    for r in results:
        print(
            f"  {r['policy']:<12} {r['requests']:>8} {len(r['errors']):>6} {r['hit']:>9.1%} "
            f"{r['ttft_p50']:>8.3f}s {r['ttft_p90']:>8.3f}s {r['same_worker']:>11.0%} "
            f"{str(r['served']):>18} {r['wall_s']:>5.0f}s"
        )
    if base is not None:
        for r in results:
            if r is not base:
                print(
                    f"  {r['policy']} vs least_load: hit {r['hit'] / max(base['hit'], 1e-9):.2f}x, "
                    f"TTFT P50 {r['ttft_p50'] / base['ttft_p50']:.2f}x, P90 {r['ttft_p90'] / base['ttft_p90']:.2f}x"
                )
    for r in results:
        for e in r["errors"][:3]:
            print(f"  {r['policy']} error: {e}")
    print(
        "  (same worker: turns that landed on the worker of the conversation's previous turn, which went "
        "through the other router; TTFT wall-clock on a shared 2-core box, so only same-run ratios mean much)"
    )
    return {"policies": results}
