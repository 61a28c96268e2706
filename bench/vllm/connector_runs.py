"""Running one arm's engines for bench/vllm/connectors.py: the spec files, the processes (in the
arm's venv, its netns), their results. An engine that fails raises EngineFailed with the last
line of its log; the bench records it in that arm's cell instead of stopping."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common.paths import REPO
from bench.vllm.connector_arms import Engine
from gcache.common.processes import stop_process
from gcache.testing.vllm_models import engine_env

ENGINE_TIMEOUT_S = 1800.0


class EngineFailed(RuntimeError):
    pass


class EngineRun:
    """One engine process over `jobs` (bench/vllm/connector_engine.py)."""

    def __init__(self, arm: Engine, base: dict[str, Any], jobs: list[dict[str, Any]], work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        spec = dict(base, **arm.spec, jobs=jobs)
        (work / "spec.json").write_text(json.dumps(spec))
        env = engine_env(work)
        env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO)))
        env.update(arm.env)
        self.log_path = work / "engine.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *arm.prefix,
                    arm.python,
                    "-m",
                    "bench.vllm.connector_engine",
                    str(work / "spec.json"),
                    str(work / "out.json"),
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def result(self) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)
            code = -1
        if code != 0 or not (self.work / "out.json").exists():
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "?")
            raise EngineFailed(f"engine exited {code}: {last.strip()[-240:]} (log: {self.log_path})")
        out: dict[str, Any] = json.loads((self.work / "out.json").read_text())
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc)


def run_engine(arm: Engine, base: dict[str, Any], jobs: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    run = EngineRun(arm, base, jobs, work)
    try:
        return run.result()
    finally:
        run.kill()


def run_engines(arm: Engine, base: dict[str, Any], jobs_each: list[list[dict[str, Any]]], work: Path) -> list[dict]:
    """Several engines at once (the throughput replay); all stopped if one fails."""
    runs = [EngineRun(arm, base, jobs, work / f"engine-{i}") for i, jobs in enumerate(jobs_each)]
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while any(r.proc.poll() is None for r in runs) and time.monotonic() < deadline:
            failed = [r for r in runs if r.proc.poll() not in (None, 0)]
            if failed:  # the others would wait for it at their next barrier
                return [failed[0].result()]  # raises EngineFailed with its log line
            time.sleep(0.5)
        return [r.result() for r in runs]
    finally:
        for r in runs:
            r.kill()
