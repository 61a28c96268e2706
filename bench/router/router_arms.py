"""The routers bench/router/vllm_trace.py compares in front of the same vLLM servers, one arm each.

gcache-router arms (python -m gcache.router.main, over the translators' Redis state):
  round_robin, least_load;
  report       the report's formula: cache_aware, score = match_weight x prefix match - normalised
               load, L3 not credited (--tier-weights 1,0.8,0);
  tier_aware   cache_aware with GCache's L3 credited (--tier-weights 1,0.8,0.5) for the engines
               whose translator says they run the connector (kv-events --l3); the L3's pages come
               from the connectors' L3 events (--l3-events) when this checkout's gcache-router
               has that option, else the arm runs without any L3 credit (it is then `report`).
The other routers, each from its own venv (bench/router/setup_routers.sh; skipped when missing):
  sglang          sglang-router 0.3.2 cache_aware (its launcher's defaults: an approximate
                  per-worker prefix tree of the text it sent, threshold 0.3, balance 64 / 1.5);
  vllm_router     vllm-router 0.1.17 cache_aware (the same algorithm, vLLM's fork);
  vllm_router_kv  vllm-router 0.1.17 kv_aware, fed by every engine's vLLM KV events
                  (--kv-event-source URL=ENDPOINT): what the engines really hold.
And a control, not run by default: report_l3ev, the report's scoring with the L3 events
subscribed (what subscribing costs the router, without the credit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.router.vllm_fleet import BLOCK, MODEL, Child, Fleet, _child_env, http_json, http_text
from gcache.common.processes import free_port

ROUTER_CACHE = Path(os.environ.get("GCACHE_ROUTER_CACHE", Path.home() / ".cache/gcache"))
READY_S = 120.0


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "gcache" | "sglang" | "vllm_router"
    args: tuple[str, ...]
    l3_events: bool = False  # gcache-router subscribes to the connectors' L3 events (when it can)


ARMS: dict[str, Arm] = {
    "round_robin": Arm("round_robin", "gcache", ("--policy", "round_robin")),
    "least_load": Arm("least_load", "gcache", ("--policy", "least_load")),
    "report": Arm("report", "gcache", ("--policy", "cache_aware", "--tier-weights", "1,0.8,0")),
    "tier_aware": Arm("tier_aware", "gcache", ("--policy", "cache_aware", "--tier-weights", "1,0.8,0.5"), True),
    # a control: the report's scoring with the L3 events subscribed (their cost without their credit)
    "report_l3ev": Arm("report_l3ev", "gcache", ("--policy", "cache_aware", "--tier-weights", "1,0.8,0"), True),
    "sglang": Arm("sglang", "sglang", ("--policy", "cache_aware")),
    "vllm_router": Arm("vllm_router", "vllm_router", ("--policy", "cache_aware")),
    "vllm_router_kv": Arm("vllm_router_kv", "vllm_router", ("--policy", "kv_aware")),
}
DEFAULT_ARMS = ("round_robin", "least_load", "report", "tier_aware", "sglang", "vllm_router_kv")


def venv_python(kind: str) -> Path:
    return ROUTER_CACHE / f"venv-{'sglang-router' if kind == 'sglang' else 'vllm-router'}" / "bin" / "python"


def unavailable(arm: Arm) -> str:
    """Why this arm cannot run here ('' when it can)."""
    if arm.kind == "gcache":
        return ""
    py = venv_python(arm.kind)
    if not py.exists():
        return f"{py.parent.parent} is missing (bench/router/setup_routers.sh builds it)"
    marker = py.parent.parent / ".unavailable"
    if marker.exists():
        return f"setup_routers.sh could not install it: {marker.read_text().strip()[-300:]}"
    return ""


def gcache_router_has_l3_events() -> bool:
    """Whether this checkout's gcache-router takes --l3-events (the connectors' L3 events)."""
    out = subprocess.run(
        [sys.executable, "-m", "gcache.router.main", "--help"], capture_output=True, text=True, env=_child_env()
    )
    return "--l3-events" in out.stdout


def command(arm: Arm, fleet: Fleet, port: int, prometheus_port: int, l3_events: bool) -> list[str]:
    urls = [e.url for e in fleet.engines]
    if arm.kind == "gcache":
        cmd = [sys.executable, "-m", "gcache.router.main", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--redis", fleet.redis.url, "--tokenizer", str(fleet.model_dir), "--request-timeout-s", "300"]
        cmd += list(arm.args)
        if arm.l3_events and l3_events:
            for e in fleet.engines:
                if e.l3_events:
                    cmd += ["--l3-events", e.l3_events]
        return cmd
    py = str(venv_python(arm.kind))
    # their Prometheus exporters default to one fixed port (29000): a free one each
    prom = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
    if arm.kind == "sglang":
        cmd = [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        return cmd + prom + ["--worker-urls", *urls, *arm.args]
    cmd = [py, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += prom + ["--worker-urls", *urls, *arm.args]
    if "kv_aware" in arm.args:
        for e in fleet.engines:
            cmd += ["--kv-event-source", f"{e.url}={e.events}"]
        cmd += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL]
    return cmd


class RouterProc(Child):
    """A running arm; `metrics_url` is where its Prometheus counters are (saved beside its log)."""

    metrics_url = ""

    def save_metrics(self) -> None:
        try:
            (self.log_path.parent / f"{self.name}.metrics.txt").write_text(http_text(self.metrics_url))
        except OSError as e:
            print(f"  ({self.name}: no metrics from {self.metrics_url}: {e})")


def start(arm: Arm, fleet: Fleet, logdir: Path, run: int, l3_events: bool) -> RouterProc:
    port, prom = free_port(), free_port()
    env = _child_env() if arm.kind == "gcache" else None
    cmd = command(arm, fleet, port, prom, l3_events)
    child = RouterProc(f"router-{arm.name}-run{run}", cmd, logdir, env, port)
    child.metrics_url = f"{child.url}/metrics" if arm.kind == "gcache" else f"http://127.0.0.1:{prom}/metrics"
    try:
        _wait_ready(child, arm, fleet)
    except BaseException:
        child.stop()
        raise
    return child


def _wait_ready(child: Child, arm: Arm, fleet: Fleet) -> None:
    """Listening, serving the model, and (gcache-router) seeing every engine registered."""
    deadline = time.monotonic() + READY_S
    want = {e.url for e in fleet.engines}
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited at start:\n{child.tail()}")
        try:
            if arm.kind == "gcache":
                status, body = http_json("GET", f"{child.url}/health", timeout=5)
                workers = body.get("workers", []) if status == 200 and isinstance(body, dict) else []
                seen = {w["url"] for w in workers if w.get("registered")}
                # every engine registered, and empty after the reset (the translators saw the clear)
                if want <= seen and not any(w.get("pages") for w in workers):
                    return
            elif http_json("GET", f"{child.url}/v1/models", timeout=5)[0] == 200:
                time.sleep(2.0)  # its first health checks of the workers
                return
        except (OSError, ValueError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{child.name} not ready within {READY_S:.0f}s:\n{child.tail()}")
