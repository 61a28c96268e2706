"""The vLLM group's helpers: does this Python have vLLM, and one engine process run.

An engine runs as `python -m gcache.testing.vllm_models SPEC OUT` in the group's venv
(single-process mode, loopback only, its files under the test's tmp dir): a fresh process
per run, so a second run's hits can only come from the store. `EngineRun` starts one and
lets the test act between two prompts (`wait_gate(i)`, change the store, `open_gate(i)`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support import REPO_ROOT

VENV_NOTE = REPO_ROOT / ".venv-vllm" / ".gcache-vllm-unavailable"
RUN_TIMEOUT_S = 600.0  # one engine process, start to result, on a loaded 2-core machine
CONNECTOR = dict(connector="GCacheConnector", module_path="gcache.integrations.vllm")
EC_CONNECTOR = dict(ec_connector="GCacheECConnector", ec_module_path="gcache.integrations.vllm")


def missing_packages() -> str | None:
    """Why the group cannot run in this Python, or None when it can."""
    absent = [name for name in ("torch", "vllm", "transformers") if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    why = f"{', '.join(absent)} not installed in this Python"
    if VENV_NOTE.exists():
        why += f"; tests/integrations/vllm/setup_venv.sh said: {VENV_NOTE.read_text().strip()}"
    return why


def gcache_spec(model, url: str, prompts, **extra_config) -> dict:
    """A spec for an engine with GCacheConnector on the store at `url`."""
    return dict(CONNECTOR, model=str(model), prompts=prompts, extra_config={"gcache_url": url, **extra_config})


def ec_spec(model, url: str, prompts, role: str = "ec_both", **extra_config) -> dict:
    """A spec for a multimodal engine with GCacheECConnector on the store at `url` (add the
    KV connector with CONNECTOR and extra_config: an engine may have both)."""
    return dict(
        EC_CONNECTOR,
        model=str(model),
        mm=True,
        prompts=prompts,
        ec_role=role,
        ec_extra_config={"gcache_url": url, **extra_config},
    )


class EngineRun:
    """One engine process over `spec`; result() waits for it and returns its JSON answer."""

    def __init__(self, spec: dict, work: Path):
        from gcache.testing.vllm_models import engine_env

        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.gates = work / "gates"
        self.gates.mkdir(exist_ok=True)
        spec = dict(spec, gate_dir=str(self.gates))
        self.spec_path, self.out_path, self.log_path = work / "spec.json", work / "out.json", work / "engine.log"
        self.spec_path.write_text(json.dumps(spec))
        env = engine_env(work)
        # gcache from this checkout (then engine_env's entries: the multimodal model's shim)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gcache.testing.vllm_models", str(self.spec_path), str(self.out_path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.started = time.monotonic()

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_gate(self, i: int) -> None:
        while not (self.gates / f"ready-{i}").exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited ({self.proc.returncode}) before prompt {i}:\n{self._tail()}")
            if time.monotonic() - self.started > RUN_TIMEOUT_S:
                self.kill()
                raise AssertionError(f"engine not at prompt {i} after {RUN_TIMEOUT_S:.0f}s:\n{self._tail()}")
            time.sleep(0.1)

    def open_gate(self, i: int) -> None:
        (self.gates / f"go-{i}").write_text("")

    def result(self) -> dict:
        try:
            code = self.proc.wait(max(1.0, RUN_TIMEOUT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"engine still running after {RUN_TIMEOUT_S:.0f}s:\n{self._tail()}") from None
        finally:
            self._log.close()
        if code != 0 or not self.out_path.exists():
            raise AssertionError(f"engine exited with {code}:\n{self._tail()}")
        answer = json.loads(self.out_path.read_text())
        answer["log"] = self.log_path.read_text(errors="replace")
        return answer

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def run_engine(spec: dict, work: Path) -> dict:
    return EngineRun(spec, work).result()


def same_output(a: dict, b: dict) -> bool:
    """Exactly the same tokens and logprobs (top-k ids and values)."""
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def same_first_token(a: dict, b: dict) -> bool:
    """a ran with max_tokens=1: its token and logprobs equal b's first."""
    return a["tokens"] == b["tokens"][:1] and a["logprobs"] == b["logprobs"][:1]
