"""Replays conversations through a router's OpenAI /v1/completions endpoint (bench/router/vllm_trace.py):
`concurrency` conversations at once, each closed loop (a turn goes when the previous one
answered). Per request, as the client sees it: TTFT (the first streamed chunk carrying a
choice), the engine's own usage (prompt tokens, prompt_tokens_details.cached_tokens) from the
final chunk, and the engine that answered when the router says (x-gcache-worker).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Sent:
    conversation: int
    turn: int
    prompt: str
    max_tokens: int


async def _one(session, base: str, model: str, s: Sent) -> dict:
    import aiohttp

    body = {
        "model": model,
        "prompt": s.prompt,
        "max_tokens": s.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict = {"conversation": s.conversation, "turn": s.turn}
    t0 = time.perf_counter()
    ttft, usage = None, None
    try:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with session.post(f"{base}/v1/completions", json=body, timeout=timeout) as resp:
            out["engine"] = resp.headers.get("x-gcache-worker", "")
            if resp.status != 200:
                return dict(out, error=f"{resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    return dict(out, error=str(chunk["error"])[:200])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return dict(out, error=f"{type(e).__name__}: {e}"[:200])
    if usage is None or ttft is None:
        return dict(out, error="stream ended without a choice or usage")
    details = usage.get("prompt_tokens_details") or {}
    return dict(out, ttft_s=ttft, prompt=int(usage["prompt_tokens"]), cached=int(details.get("cached_tokens") or 0))


async def _replay(base: str, model: str, conversations: list[list[Sent]], concurrency: int) -> list[dict]:
    import aiohttp

    queue: asyncio.Queue[list[Sent]] = asyncio.Queue()
    for c in conversations:
        queue.put_nowait(c)
    rows: list[dict] = []

    async def client() -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    conv = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                for s in conv:
                    r = await _one(session, base, model, s)
                    rows.append(r)
                    if "error" in r:
                        break  # the rest of this conversation would not be a follow-up any more

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return rows


def replay(base: str, model: str, conversations: list[list[Sent]], concurrency: int) -> list[dict]:
    return asyncio.run(_replay(base, model, conversations, concurrency))
