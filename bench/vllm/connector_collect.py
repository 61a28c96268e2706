"""Rebuilding bench/vllm/connectors.py's results from the engines' own files in a work dir
(spec.json + out.json per engine): the tables of a run that was cut short, or of every round
that finished (`--from-work DIR`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def assemble(per_engine: list[list[list[dict[str, Any]]]], outs: list[dict[str, Any]]) -> tuple[float, dict]:
    """The throughput replay's wall time (sum over waves of first start .. last end, over
    engines) and each request's result keyed "conversation-turn"."""
    wall = 0.0
    results: dict[str, Any] = {}
    for w in range(len(per_engine[0])):
        stamps = [o["jobs"][0]["waves"][w] for o in outs]
        wall += max(s["end"] for s in stamps) - min(s["start"] for s in stamps)
        for e, s in enumerate(stamps):
            for req, res in zip(per_engine[e][w], s["results"]):
                results[f"{req['key'][0]}-{req['key'][1]}"] = dict(res, prompt=len(req["prompt"]))
    return wall, results


def _read(d: Path) -> tuple[dict, dict] | None:
    spec, out = d / "spec.json", d / "out.json"
    if not (spec.exists() and out.exists()):
        return None
    return json.loads(spec.read_text()), json.loads(out.read_text())


def collect_arm(arm_dir: Path) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    for part in ("llama", "hybrid"):
        got = _read(arm_dir / part / "b")
        if got is None:
            continue
        spec, out = got
        for job, res in zip(spec["jobs"], out["jobs"]):
            cells[job["cell"]] = res["runs"]
    engines = sorted((arm_dir / "throughput").glob("engine-*"))
    read = [_read(e) for e in engines]
    if len(read) == 2 and all(r is not None for r in read):
        per_engine = [r[0]["jobs"][0]["waves"] for r in read if r is not None]
        wall, results = assemble(per_engine, [r[1] for r in read if r is not None])
        cells["throughput"] = dict(wall_s=wall, results=results)
    return cells


def collect(work: Path) -> list[dict[str, Any]]:
    """Every round folder r0, r1, ... in order: {arm: cells} for what finished."""
    rounds = []
    for rdir in sorted(work.glob("r[0-9]*"), key=lambda p: int(p.name[1:])):
        rounds.append({a.name: collect_arm(a) for a in sorted(rdir.iterdir()) if a.is_dir()})
    return rounds
