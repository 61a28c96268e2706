"""The engine's output checked against the dense float64 reference model (worker and hicache tests)."""

from __future__ import annotations

import numpy as np

from gcache.worker.engine.request import Request
from gcache.worker.model.transformer import Model

LOGIT_ATOL = 1e-9


def expected_sample(row: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(row))
    z = row / temperature
    cdf = np.cumsum(np.exp(z - z.max()))
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), row.size - 1))


def check_against_reference(model: Model, r: Request) -> None:
    """Logits within LOGIT_ATOL of the dense float64 reference, and every token is what the
    request's own seeded sampler draws from those reference logits."""
    seq = np.asarray(list(r.prompt) + r.output[:-1], dtype=np.int64)
    ref = np.asarray(model.reference_logits(seq))
    n0 = len(r.prompt) - 1
    assert len(r.logits) == len(r.output) >= 1
    rng = np.random.default_rng(r.params.seed if r.params.seed is not None else r.rid)
    for k, tok in enumerate(r.output):
        np.testing.assert_allclose(r.logits[k], ref[n0 + k], rtol=0, atol=LOGIT_ATOL)
        assert tok == expected_sample(ref[n0 + k], r.params.temperature, rng), f"{r}: token {k} differs"
