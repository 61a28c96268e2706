"""A real PD run: 1 prefill + 1 decode gcache-worker, one gcache-server, one gcache-router
(--prefill-workers/--decode-workers), beside 2 mixed gcache-workers behind a router (same
worker count); real numpy model, OpenAI streaming client (aiohttp, SSE).

    python -m bench.pd.real                 # 3 runs, ~2-4 min on 2 busy cores
    python -m bench.pd.real --runs 1 --requests 6

Per run the same requests go to both setups (fresh processes per setup and run): long
prompts (--long-tokens) among short decode-heavy ones, --concurrency at a time. Measured per
request, client-side: TTFT = first chunk with text; TPOT = (last text chunk - first) /
(chunks with text - 1); the answer text, which must equal the mixed setup's (greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common.processes import Proc
from bench.common.stats import median_range
from gcache.common.processes import free_port
from gcache.tools.devcluster.local_server import LocalServer

START_TIMEOUT_S = 90.0
DTYPE: list[str] = []  # --dtype for every worker (main sets it)
REQUEST_TIMEOUT_S = 300.0


def worker(name: str, logdir: Path, extra: list[str]) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "gcache.worker.http.server", "--port", str(port), "--model-name", "bench-pd"]
    argv += ["--max-prompt-tokens", "8192", "--max-new-tokens", "512", "--kv-budget-mib", "96", *DTYPE, *extra]
    return Proc(name, argv, port, logdir, START_TIMEOUT_S)


def router(name: str, logdir: Path, extra: list[str]) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "gcache.router.main", "--port", str(port), *extra]
    return Proc(name, argv, port, logdir, START_TIMEOUT_S)


def requests_for(seed: int, n: int, long_tokens: int) -> list[dict]:
    """Printable ASCII prompts (1 char = 1 token): every 3rd long, the others short and decode-heavy."""
    rng = np.random.default_rng(seed)
    text = lambda k: "".join(chr(c) for c in rng.integers(97, 123, int(k)))  # noqa: E731
    out = []
    for i in range(n):
        long = i % 3 == 0
        out.append(
            {
                "prompt": text(long_tokens if long else rng.integers(100, 300)),
                "max_tokens": 24 if long else 96,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "long": long,
            }
        )
    return out


async def one(session, url: str, req: dict) -> dict:
    import aiohttp

    body = {k: v for k, v in req.items() if k != "long"}
    t0 = time.perf_counter()
    stamps, text = [], []
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(REQUEST_TIMEOUT_S)) as r:
        if r.status != 200:
            return {"error": f"{r.status}: {(await r.text())[:200]}"}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": str(chunk["error"])[:200]}
            piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if piece:
                stamps.append(time.perf_counter() - t0)
                text.append(piece)
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return {"ttft_s": stamps[0], "tpot_s": tpot, "text": "".join(text), "long": req["long"]}


async def client(url: str, reqs: list[dict], concurrency: int) -> list[dict]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def go(q):
            async with sem:
                return await one(session, url, q)

        return await asyncio.gather(*(go(q) for q in reqs))


def run_setup(kind: str, reqs: list[dict], args, logdir: Path) -> list[dict]:
    procs: list = []
    server = None
    try:
        if kind == "pd":
            server = LocalServer(logdir / "store", memory="512MiB", disk="1GiB").start()
            l3 = ["--l3", server.address, "--l2-mib", "128"]
            p = worker("prefill", logdir, ["--role", "prefill", *l3])
            d = worker("decode", logdir, ["--role", "decode", *l3])
            procs += [p, d]
            for x in procs:
                x.wait_listening()
            r = router(
                "router-pd",
                logdir,
                ["--prefill-workers", p.url, "--decode-workers", d.url, "--pd-min-prompt-tokens", str(args.pd_min)],
            )
        else:
            ms = [worker(f"mixed{i}", logdir, []) for i in range(2)]
            procs += ms
            for x in procs:
                x.wait_listening()
            r = router("router-mixed", logdir, ["--workers", ",".join(m.url for m in ms), "--policy", "least_load"])
        procs.append(r)
        r.wait_listening()
        return asyncio.run(client(r.url, reqs, args.concurrency))
    finally:
        for x in reversed(procs):
            x.stop()
        if server is not None:
            server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pd.real", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--first-run", type=int, default=0, help="seed of the first run (run i uses seed i)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="", help="the workers' --dtype")
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument(
        "--pd-min-prompt-tokens", dest="pd_min", type=int, default=0, help="the PD router's bypass (0: all through PD)"
    )
    args = ap.parse_args(argv)
    DTYPE[:] = ["--dtype", args.dtype] if args.dtype else []
    per = {"mixed": [], "pd": []}
    t0 = time.perf_counter()
    for run in range(args.first_run, args.first_run + args.runs):
        reqs = requests_for(run, args.requests, args.long_tokens)
        with tempfile.TemporaryDirectory(prefix="bench-pd-real-") as tmp:
            got = {k: run_setup(k, reqs, args, Path(tmp)) for k in ("mixed", "pd")}
        bad = [r for rs in got.values() for r in rs if "error" in r]
        if bad:
            print(f"run {run}: {len(bad)} requests failed, e.g. {bad[0]['error']}")
            return 1
        same = sum(a["text"] == b["text"] for a, b in zip(got["mixed"], got["pd"]))
        print(f"run {run}: {same}/{len(reqs)} PD answers equal to mixed ({time.perf_counter() - t0:.0f} s)", flush=True)
        for i, (a, b) in enumerate(zip(got["mixed"], got["pd"])):
            if a["text"] != b["text"]:
                at = next((k for k, (x, y) in enumerate(zip(a["text"], b["text"])) if x != y), None)
                kind = "long" if reqs[i]["long"] else "short"
                print(f"  request {i} ({kind}, {len(reqs[i]['prompt'])} tokens) differs from char {at} on")
        for k, rs in got.items():
            per[k].append(rs)
    ms = lambda v: f"{v * 1e3:.0f}"  # noqa: E731
    print(
        f"\n{args.requests} requests per run ({args.requests // 3 + (args.requests % 3 > 0)} of {args.long_tokens} "
        f"tokens, 24 out; the others 100-300 in, 96 out), {args.concurrency} at a time; ms, median [min..max] over "
        f"{args.runs} runs; PD router --pd-min-prompt-tokens {args.pd_min}"
    )
    print(f"{'setup':>6} {'TTFT P50':>18} {'TTFT P90':>18} {'TPOT P50':>14} {'TPOT P90':>14}")
    q = lambda rs, key, p: float(np.nanpercentile([r[key] for r in rs], p))  # noqa: E731
    for k in ("mixed", "pd"):
        runs = per[k]
        print(
            f"{k:>6} {median_range([q(rs, 'ttft_s', 50) for rs in runs], ms):>18} "
            f"{median_range([q(rs, 'ttft_s', 90) for rs in runs], ms):>18} "
            f"{median_range([q(rs, 'tpot_s', 50) for rs in runs], ms):>14} "
            f"{median_range([q(rs, 'tpot_s', 90) for rs in runs], ms):>14}"
        )
    rt = lambda v: f"{v:.2f}x"  # noqa: E731
    tp = [q(m, "tpot_s", 90) / q(p, "tpot_s", 90) for m, p in zip(per["mixed"], per["pd"])]
    tt = [q(p, "ttft_s", 90) / q(m, "ttft_s", 90) for m, p in zip(per["mixed"], per["pd"])]
    print(f"ratios per run: TPOT P90 mixed/PD {median_range(tp, rt)}; TTFT P90 PD/mixed {median_range(tt, rt)}")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
