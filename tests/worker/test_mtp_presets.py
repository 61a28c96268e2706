"""The shipped MTP presets (gcache/worker/model/presets, `--preset tiny-mtp` / `tiny-mtp-recur`):
they load with their geometry, decode deterministically to bytes, and MTP keeps the greedy
output; tiny_mtp_recur's drafts read their window (issue 30, point 4): with the MTP blocks'
attention output zeroed, greedy acceptance on a fixed recurring prompt drops. No timing."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import pytest

from bench.worker.mtp_acceptance import ablated_mtp_window
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.request import SamplingParams
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.http.flags import SHIPPED_WEIGHTS
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.model.transformer import Model
from gcache.worker.model.weights import load

# 120 bytes (the lag the recur preset's spans repeat at), then their first 64 again: a span recurring
SPAN = (
    b"def area(w, h):\n    return w * h\n\n\nclass Box:\n    def __init__(self, w, h):\n"
    b"        self.w, self.h = w, h\n    size = 0\n\n"
)
assert len(SPAN) == 120
RECURRING = list(SPAN + SPAN[:64])


@pytest.fixture(scope="module", params=sorted(SHIPPED_WEIGHTS))
def preset(request):
    cfg, weights = load(SHIPPED_WEIGHTS[request.param])
    return request.param, cfg, weights, Model(cfg, weights)


def decode(model, mtp: int, prompt, tokens: int) -> tuple[list[int], int, int]:
    """Greedy output of one request, and the drafts proposed and accepted."""
    sc = SchedulerConfig(max_tokens_per_step=512, chunk_tokens=256, max_running=2)
    ec = EngineConfig(max_prompt_tokens=1024, max_new_tokens=256, mtp_layers=mtp, scheduler=sc)
    e = Engine(model, DualKVCache(model.config, 64, 64), ec)
    try:
        r = e.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0))
        e.run_until_idle(on_step=e.check_integrity)
        s = e.metrics.snapshot()
        drafted = sum(v for k, v in s.items() if k.startswith("spec_drafted_out_"))
        accepted = sum(v for k, v in s.items() if k.startswith("spec_accepted_out_"))
        return list(r.output), drafted, accepted
    finally:
        e.close()


def test_a_shipped_preset_loads_with_its_geometry(preset):
    name, cfg, weights, _ = preset
    assert (cfg.vocab_size, cfg.hidden, cfg.layers, cfg.mtp_layers, cfg.dtype) == (260, 96, 4, 3, "float32")
    assert cfg.window == {"tiny-mtp": 64, "tiny-mtp-recur": 128}[name]
    assert all(np.isfinite(w).all() for w in weights.values())
    assert SHIPPED_WEIGHTS[name].stat().st_size < 4 << 20  # small, like the first one


def test_a_shipped_preset_decodes_deterministically_and_mtp_keeps_the_greedy_output(preset):
    _, _, _, model = preset
    out, _, _ = decode(model, 0, RECURRING, 48)
    again, _, _ = decode(model, 0, RECURRING, 48)
    spec, drafted, _ = decode(model, 3, RECURRING, 48)
    assert out == again == spec
    assert len(out) == 48 and all(0 <= t < 256 for t in out)  # bytes (no special id)
    assert drafted > 0


def test_the_recur_presets_drafts_read_their_window():
    """Greedy, so deterministic: the continuation of a span recurring at the lag is copied, and
    the MTP blocks find it in their window; with their attention output zeroed they draft
    from the last hidden state alone, and acceptance drops (the shipped tiny-mtp's does not)."""
    cfg, weights = load(SHIPPED_WEIGHTS["tiny-mtp-recur"])
    model = Model(cfg, weights)
    out, drafted, accepted = decode(model, 3, RECURRING, 48)
    with ablated_mtp_window():
        out0, drafted0, accepted0 = decode(model, 3, RECURRING, 48)
    assert out == out0  # the drafts never decide the output
    assert bytes(out[:24]) == SPAN[64:88]  # the main model copies the span
    with_window, without = accepted / drafted, accepted0 / drafted0
    assert with_window > 0.8 and with_window > without + 0.3, (with_window, without)
