"""How often the router's prompt pages are the vLLM engine's: the router tokenizes a request
with the model's own tokenizer and chat template (gcache.router.engine_prompts) and the
engine says which tokens it ran (vLLM's `return_token_ids`); the translator names the blocks
the engine stored (gcache-router kv-events, in Redis).

Per request (chat or completion, against the engine directly):
  tokens  the router's token ids == the engine's prompt_token_ids
  pages   of the engine prompt's whole blocks, the share whose page id the router computes
          (the leading run: the chain makes every page after a mismatch differ)
  stored  with --redis: of the router's page ids for the prompt's whole blocks, the share
          the engine's translator published (what the router will credit)

    .venv-vllm/bin/python -m bench.router.vllm_agreement --engine http://127.0.0.1:8001 \\
        --tokenizer /models/m [--redis redis://127.0.0.1:6379/0] [--requests 200]

The corpus is synthetic and deliberately awkward: multi-turn chats that append the engine's
own answers, system and developer messages, content as lists of text parts, unicode,
emoji, runs of spaces, tabs and newlines, and completions with string prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.request

from gcache.router.engine_prompts import ModelTokenizer
from gcache.serving.redis_layout import Keys, id_bytes, page_ids

WORDS = (
    "the quick brown fox jumps over lazy dog router engine cache block prefix token window "
    "summarise document question answer Paris France capital café naïve déjà-vu 中文 测试 日本語 "
    "emoji 🙂 🚀 ∑ λ → x² 3.14159 1,234,567 2026-12-02 https://example.com/a?b=c#d <tag> {json: 1} "
    "don't can't it's O'Brien ''quoted'' `code` snake_case CamelCase 12ab34 ####"
).split()


def _text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        sep = rng.choices([" ", "  ", "\n", "\t", ", ", ". ", "\n\n", ""], [30, 2, 3, 1, 3, 3, 1, 1])[0]
        out.append(w + sep)
    return "".join(out).strip() or "hello"


def corpus(n: int, seed: int = 0):
    """(kind, payload-maker) items; a chat's later turns need the previous answers."""
    rng = random.Random(seed)
    items = []
    while len(items) < n:
        if rng.random() < 0.2:
            items.append(("completion", {"prompt": _text(rng, rng.randrange(5, 30))}))
            continue
        msgs = []
        if rng.random() < 0.5:
            msgs.append({"role": rng.choice(["system", "developer"]), "content": _text(rng, rng.randrange(5, 30))})
        turns = rng.randrange(1, 5)
        conv = {"messages": msgs, "turns": []}
        for _ in range(turns):
            t = _text(rng, rng.randrange(3, 40))
            if rng.random() < 0.3:
                cut = len(t) // 2
                content = [{"type": "text", "text": t[:cut]}, {"type": "text", "text": t[cut:]}]
            else:
                content = t
            conv["turns"].append({"role": "user", "content": content})
        items.append(("chat", conv))
    return items[:n]


def _post(url: str, path: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path}: HTTP {e.code}: {e.read()[:500]!r}") from None


def _leading(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(
    engine: str,
    tokenizer: str,
    requests: int = 100,
    seed: int = 0,
    model: str | None = None,
    redis_url: str = "",
    block_size: int = 32,
    max_tokens: int = 8,
    settle_s: float = 10.0,
) -> dict:
    tok = ModelTokenizer(tokenizer)
    r = None
    if redis_url:
        import redis

        r = redis.Redis.from_url(redis_url)
    counts = dict(requests=0, tokens_equal=0, pages=0, pages_equal=0, stored_pages=0, stored_found=0)
    misses = []
    for kind, item in corpus(requests, seed):
        bodies = []
        if kind == "completion":
            bodies.append(("completion", dict(item)))
        else:
            msgs = list(item["messages"])
            for turn in item["turns"]:
                msgs.append(turn)
                bodies.append(("chat", {"messages": list(msgs)}))
                msgs.append({"role": "assistant", "content": None})  # filled with the answer below
        answer = None
        for k, body in bodies:
            if k == "chat" and answer is not None:
                for m in body["messages"]:
                    if m["role"] == "assistant" and m["content"] is None:
                        m["content"] = answer
            body.update(max_tokens=max_tokens, temperature=0, return_token_ids=True)
            if model:
                body["model"] = model
            path = "/v1/chat/completions" if k == "chat" else "/v1/completions"
            out = _post(engine, path, body)
            engine_ids = out.get("prompt_token_ids") or out["choices"][0].get("prompt_token_ids")
            answer = out["choices"][0]["message"]["content"] if k == "chat" else None
            for m in body["messages"] if k == "chat" else ():
                if m["role"] == "assistant" and m["content"] is None:
                    m["content"] = answer
            ours = tok.tokens(k == "chat", body)
            counts["requests"] += 1
            counts["tokens_equal"] += ours == engine_ids
            theirs_p, ours_p = page_ids(engine_ids, block_size), page_ids(ours, block_size)
            counts["pages"] += len(theirs_p)
            counts["pages_equal"] += _leading(theirs_p, ours_p)
            if ours != engine_ids and len(misses) < 5:
                i = _leading(ours, engine_ids)
                misses.append(dict(kind=k, at=i, ours=ours[i : i + 8], engine=engine_ids[i : i + 8]))
            if r is not None:
                want = ours_p[: len(ours) // block_size]  # vLLM caches every whole prompt block
                if want:
                    key = Keys().pages(engine.rstrip("/"))
                    deadline = time.monotonic() + settle_s  # the engine's event, the translator's flush
                    while True:
                        found = sum(f is not None for f in r.hmget(key, [id_bytes(p) for p in want]))
                        if found == len(want) or time.monotonic() > deadline:
                            break
                        time.sleep(0.05)
                    counts["stored_pages"] += len(want)
                    counts["stored_found"] += found
    c = counts
    return dict(
        counts,
        token_agreement=c["tokens_equal"] / max(1, c["requests"]),
        page_agreement=c["pages_equal"] / max(1, c["pages"]),
        stored_agreement=(c["stored_found"] / c["stored_pages"]) if c["stored_pages"] else None,
        first_mismatches=misses,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--tokenizer", required=True, help="the model directory the engine serves")
    ap.add_argument("--model", default=None)
    ap.add_argument("--redis", default="", help="the translator's Redis (adds the stored-pages check)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args(argv)
    res = measure(args.engine, args.tokenizer, args.requests, args.seed, args.model, args.redis, args.block_size)
    print(json.dumps(res, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
