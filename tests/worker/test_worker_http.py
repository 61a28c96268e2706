"""gcache-worker over real HTTP: a real subprocess on a free port, stdlib client."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matmuls: threads only add contention

import json
from pathlib import Path

import numpy as np
import pytest

from gcache.worker.config import ModelConfig
from gcache.worker.model.transformer import Model
from tests.support.serving_support import TINY, WorkerProc, request

pytestmark = pytest.mark.process  # starts processes


class Worker(WorkerProc):
    """gcache-worker (tests.support.serving_support's launcher) and the calls these tests make."""

    def __init__(self, tmp_path: Path, extra=()) -> None:
        super().__init__(tmp_path, extra)
        self.start()

    def request(self, method: str, path: str, body: bytes | None = None, headers=None):
        status, data, resp_headers = request(self.port, method, path, body, headers)
        return status, data, resp_headers.get("content-type")

    def get(self, path: str):
        return self.request("GET", path)

    def complete(self, payload) -> tuple[int, dict]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, data, _ = self.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        return status, json.loads(data)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker"))
    yield w
    w.stop()
    assert w.proc.returncode == 0, "worker did not shut down cleanly on SIGTERM"


def test_completion_round_trip_matches_reference(worker):
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 512, size=70)]
    status, r = worker.complete({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200, r
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == 8 and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {
        "prompt_tokens": 70,
        "completion_tokens": 8,
        "total_tokens": 78,
        "prompt_tokens_details": {"cached_tokens": 0, "cached_tokens_by_tier": {"l1": 0, "l2": 0, "l3": 0}},
    }
    assert r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"]
    # Greedy output equals the dense float64 reference model, token for token.
    ref = Model(ModelConfig(**TINY)).reference_logits(np.asarray(prompt + ids[:-1]))
    assert ids == [int(np.argmax(ref[69 + k])) for k in range(8)]


def test_repeated_prompt_hits_the_cache_and_gives_the_same_text(worker):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    req = {"prompt": text, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    s1, first = worker.complete(req)
    s2, second = worker.complete(req)
    assert s1 == s2 == 200
    assert first["usage"]["prompt_tokens"] == len(text.encode())
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 8 == 0 and cached < len(text.encode())
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_seeded_sampling_is_reproducible(worker):
    req = {"prompt": "hello sampling", "max_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    a, b = worker.complete(req), worker.complete(req)
    assert a[0] == b[0] == 200
    assert a[1]["choices"][0]["token_ids"] == b[1]["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        ({"max_tokens": 4}, "missing required field: prompt"),
        ({"prompt": 42}, "prompt must be a string or a list"),
        ({"prompt": ""}, "must not be empty"),
        ({"prompt": [1, "a"]}, "prompt must be a string or a list"),
        ({"prompt": ["a", "b"]}, "batched prompts"),
        ({"prompt": [1, 99999]}, "out of range"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens must be an integer"),
        ({"prompt": "x", "max_tokens": 65}, "exceeds the limit 64"),
        ({"prompt": "x" * 601}, "limit is 600"),
        ({"prompt": "x", "temperature": 3}, "temperature must be a number in [0, 2]"),
        ({"prompt": "x", "seed": -1}, "seed must be an integer"),
        ({"prompt": "x", "stream": "yes"}, "stream must be a boolean"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed with stream=true"),
        ({"prompt": "x", "n": 2}, "n=2 is not supported"),
        ({"prompt": "x", "bogus": 1}, "unsupported field(s): bogus"),
    ],
)
def test_bad_requests_get_400_with_a_clear_message(worker, payload, fragment):
    status, body = worker.complete(payload)
    assert status == 400, body
    assert fragment in body["error"]["message"]
    assert body["error"]["code"] == 400


def test_unknown_endpoint_and_missing_length(worker):
    status, body, _ = worker.request("GET", "/nope")
    assert status == 404 and "no such endpoint" in json.loads(body)["error"]["message"]
    status, body, _ = worker.request("POST", "/v1/nope", b"{}")
    assert status == 404 and json.loads(body)["error"]["message"] == "no such endpoint: POST /v1/nope"
    status, body, _ = worker.request("POST", "/v1/chat/completions", b"{}")
    assert status == 400 and "missing required field: messages" in json.loads(body)["error"]["message"]


def test_health_and_metrics(worker):
    status, body, _ = worker.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert "l3" not in json.loads(body)  # no --l3: nothing to say about it
    worker.complete({"prompt": "metrics please", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    status, body, ctype = worker.get("/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    text = body.decode()
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["gcache_worker_requests_total"] >= 1
    assert values["gcache_worker_generation_tokens_total"] >= 3
    assert values['gcache_worker_ttft_seconds_bucket{le="+Inf"}'] == values["gcache_worker_ttft_seconds_count"]
    assert values["gcache_worker_full_pool_pages_total"] > 0 and values["gcache_worker_swa_pool_pages_total"] > 0
    assert "gcache_worker_cached_prompt_tokens_total" in values
    assert values["gcache_worker_requests_rejected_total"] >= 0
