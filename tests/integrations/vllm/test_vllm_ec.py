"""GCacheECConnector (vLLM's encoder-cache connector) in real vLLM engines, tiny LLaVA model.

One store, then fresh engine processes in turn: a connector-less baseline, A (ec_both, cold:
encodes and saves each image's embedding), another model identity on the same weights (never
reads A's items), one with both connectors (the KV connector beside this one), and B
(ec_both), whose prompts each start with vLLM's prefix and encoder
caches emptied, so every item is either loaded from the store or encoded. Between two of B's
prompts the store is changed under it: a stored embedding's bytes flipped in the server's
memory, then the server killed.

Encoder forwards are counted twice, by vLLM's own decisions: the scheduler side counts the
items vLLM's scheduler put on the encoder (`items_encoded`, from each step's
scheduled_encoder_inputs), the worker side the encoder outputs vLLM's model runner produced
(`encoder_outputs`, one save_caches call per item encoded). Items taken from the store are
`items_loaded`. Every output equals the baseline's exactly (tokens and top-3 logprobs).
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from gcache.testing.vllm_mm import data_url, prompt, write_png
from tests.support.servers import ServerProcess
from tests.support.vllm_store import flip_byte
from tests.support.vllm_support import CONNECTOR, EngineRun, ec_spec, run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(1800)]

T = prompt(10, 5, seed=1)  # 10 words, one image (16 tokens), 5 words
T2 = prompt(6, 4, seed=2, images=2)


def pil(seed: int, text: str = T) -> dict:
    return {"text": text, "images": [{"seed": seed}]}


@pytest.fixture(scope="module")
def ec(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("ec")
    sock = f"{tempfile.mkdtemp(prefix='gc-vllm-')}/node.sock"  # a socket path must stay short
    server = ServerProcess(work / "store", extra_args=["--unix-socket", sock]).start()
    url, model = server.address, models["llava"]
    media = work / "media"
    media.mkdir()
    write_png(5, media / "a.png")
    shutil.copy(media / "a.png", media / "b.png")  # the same bytes under another name
    write_png(1, media / "one.png")  # the pixels of pil(1), read from a file
    P1, P2, P3, P4 = pil(1), pil(2), pil(3), pil(4)
    TWO = {"text": T2, "images": [{"seed": 1}, {"seed": 9}]}  # one item stored, one not
    UA = {"text": T, "urls": [f"file://{media}/a.png"]}
    UB = {"text": T, "urls": [f"file://{media}/b.png"]}
    UD = {"text": T, "urls": [data_url(media / "a.png")]}
    F1 = {"text": T, "images": [{"file": str(media / "one.png")}]}
    common = dict(media_dir=str(media), reset_between=True)
    out = {}
    try:
        out["base"] = run_engine(
            dict(model=str(model), mm=True, prompts=[P1, P2, P3, P4, UA, TWO], **common), work / "base"
        )
        out["a"] = run_engine(dict(ec_spec(model, url, [P1, P3, P4, UA]), **common), work / "a")
        out["other"] = run_engine(
            dict(ec_spec(model, url, [P1], gcache_model="another-model"), **common), work / "other"
        )
        # Both connectors in one engine: the KV connector (GCacheConnector) beside this one.
        kv = dict(CONNECTOR, extra_config={"gcache_url": url})
        out["both"] = run_engine(dict(ec_spec(model, url, [P1]), **kv, **common), work / "both")
        spec = dict(
            ec_spec(model, url, [P1, P2, TWO, P3, F1, UB, UD, P4, P1], gcache_suspect_s=600),
            gates=[3, 7],
            **common,
        )
        b = EngineRun(spec, work / "b")
        try:
            b.wait_gate(3)
            p3_key = new_keys(out["a"], 1)
            assert len(p3_key) == 1, p3_key
            flip_byte(sock, p3_key[0].encode(), at=100)  # a payload byte (the header is 64)
            b.open_gate(3)
            b.wait_gate(7)
            server.kill()
            b.open_gate(7)
            out["b"] = b.result()
        finally:
            b.kill()
        yield out
    finally:
        server.kill()


def new_keys(run: dict, i: int) -> list:
    """The keys prompt i of `run` saved."""
    before = set(run["results"][i - 1]["ec"]["saved_keys"]) if i else set()
    return [k for k in run["results"][i]["ec"]["saved_keys"] if k not in before]


def delta(run: dict, i: int, side: str) -> dict:
    """What the encoder cache's `side` ("scheduler" or "worker") counted for prompt i."""
    now = run["results"][i]["ec"][side]
    before = run["results"][i - 1]["ec"][side] if i else dict.fromkeys(now, 0)
    return {k: now[k] - before[k] for k in now}


def encoded(run: dict, i: int) -> tuple:
    """(items vLLM's scheduler put on the encoder, encoder outputs the model runner made)."""
    return delta(run, i, "scheduler")["items_encoded"], delta(run, i, "worker")["encoder_outputs"]


def test_cold_engine_encodes_and_saves_each_image(ec):
    a, base = ec["a"], ec["base"]["results"]
    for i, want in enumerate([0, 2, 3, 4]):  # P1, P3, P4, UA
        assert encoded(a, i) == (1, 1)
        assert delta(a, i, "scheduler")["items_missing"] == 1
        assert delta(a, i, "worker")["items_saved"] == 1
        assert len(new_keys(a, i)) == 1
        assert same_output(a["results"][i], base[want])
    worker = a["counters"]["ec"]["worker"]
    assert worker["bytes_saved"] == 4 * (64 + 16 * 128 * 4)  # header + 16 x 128 float32
    assert worker["saves_dropped"] == worker["saves_failed"] == worker["saves_mismatch"] == 0
    key = a["results"][0]["ec"]["saved_keys"][0]
    assert ".ec-image-float32w128-e" in key


def test_fresh_engine_loads_the_embedding_and_never_runs_its_encoder(ec):
    b, a, base = ec["b"], ec["a"]["results"], ec["base"]["results"]
    assert encoded(b, 0) == (0, 0)
    assert delta(b, 0, "scheduler")["items_found"] == 1
    assert delta(b, 0, "worker")["items_loaded"] == 1
    assert delta(b, 0, "worker")["bytes_loaded"] == 16 * 128 * 4
    assert same_output(b["results"][0], base[0])
    assert same_output(b["results"][0], a[0])


def test_another_image_with_the_same_text_is_a_miss_and_differs(ec):
    b, base = ec["b"], ec["base"]["results"]
    assert encoded(b, 1) == (1, 1)
    assert delta(b, 1, "scheduler")["items_missing"] == 1
    assert same_output(b["results"][1], base[1])
    assert b["results"][1]["tokens"] != b["results"][0]["tokens"]


def test_a_request_asks_for_all_its_items_in_one_batch(ec):
    b, base = ec["b"], ec["base"]["results"]
    sched = delta(b, 2, "scheduler")
    assert (sched["requests_looked_up"], sched["items_looked_up"]) == (1, 2)
    assert (sched["items_found"], sched["items_missing"]) == (1, 1)
    assert encoded(b, 2) == (1, 1)  # the second image only
    assert delta(b, 2, "worker")["items_loaded"] == 1
    assert same_output(b["results"][2], base[5])


def test_a_flipped_stored_embedding_is_a_miss_and_the_encoder_runs(ec):
    b, base = ec["b"], ec["base"]["results"]
    sched = delta(b, 3, "scheduler")
    assert sched["items_found"] == 0 and sched["items_missing"] == 1  # the client's checksum: a miss
    assert sched["corrupt_values_removed"] == 1  # so the engine's save stores good bytes again
    assert encoded(b, 3) == (1, 1)
    assert delta(b, 3, "worker")["items_saved"] == 1
    assert same_output(b["results"][3], base[2])


def test_the_same_pixels_from_a_file_hit(ec):
    b, base = ec["b"], ec["base"]["results"]
    assert encoded(b, 4) == (0, 0)
    assert delta(b, 4, "worker")["items_loaded"] == 1
    assert same_output(b["results"][4], base[0])


def test_the_same_bytes_under_another_file_name_or_as_a_data_url_hit(ec):
    b, base = ec["b"], ec["base"]["results"]
    for i in (5, 6):  # b.png (a copy of the a.png A served), then a data: URL of those bytes
        assert encoded(b, i) == (0, 0)
        assert delta(b, i, "worker")["items_loaded"] == 1
        assert same_output(b["results"][i], base[4])


def test_a_killed_store_costs_misses_only(ec):
    b, base = ec["b"], ec["base"]["results"]
    for i, want in ((7, 3), (8, 0)):  # P4 (stored by A), P1 (loaded at prompt 0)
        assert encoded(b, i) == (1, 1)
        assert delta(b, i, "scheduler")["items_found"] == 0
        assert same_output(b["results"][i], base[want])
    sched = b["counters"]["ec"]["scheduler"]
    assert sched["store_errors"] + sched["calls_while_suspect"] >= 1
    assert sched["defer_timeouts"] == 0  # a dead store answers at once: nobody waited it out


def test_another_model_identity_never_reads_these_items(ec):
    other, a, base = ec["other"], ec["a"], ec["base"]["results"]
    assert encoded(other, 0) == (1, 1)
    assert delta(other, 0, "scheduler")["items_found"] == 0
    assert same_output(other["results"][0], base[0])
    (key,) = new_keys(other, 0)
    assert key.endswith("_another-model") and key not in a["counters"]["ec"]["saved_keys"]


def test_the_kv_connector_and_the_encoder_cache_run_in_one_engine(ec):
    both, base = ec["both"], ec["base"]["results"]
    assert encoded(both, 0) == (0, 0)
    assert delta(both, 0, "worker")["items_loaded"] == 1
    assert same_output(both["results"][0], base[0])
    assert "worker" in both["counters"] and "scheduler" in both["counters"]  # the KV connector's
