"""GCacheConnector with hybrid models whose recurrent layers keep a state (vLLM's MambaSpec
groups) in real vLLM engines: a Nemotron-H-style model (Mamba2 + attention, fp32, with the
test harness's Mamba2 CPU patch) and a Qwen3-Next-style model (gated delta net + attention,
bf16), both tiny and written offline (gcache.testing.vllm_hybrid_models).

vLLM forces the block size up for these (128 and 640 tokens here) and runs prefills in chunks
cut at block boundaries; it offers the connector the states it computed at a chunk's end and,
with prefix_cache_retention_interval=None, those reached while decoding. A fresh engine B
loads a prompt's attention pages and states at the prompt's last boundary, and a continuation
(prompt + answer + new text) beyond the first prompt; the outputs equal a run without the
connector (or, for the continuation, the engine's own local hit on the same decode-time
state: a state built while decoding differs slightly from one rebuilt by prefill).
"""

from __future__ import annotations

import tempfile

import pytest

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import GroupTag, PageKeys, prompt_page_hashes
from gcache.testing.vllm_hybrid_models import HYBRID_DTYPE, write_hybrid
from gcache.testing.vllm_models import prompt_tokens
from tests.support.servers import ServerProcess
from tests.support.vllm_store import flip_byte
from tests.support.vllm_support import EngineRun, gcache_spec, run_engine, same_output

pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]

DECODE = 100  # tokens decoded after a prompt: crosses one more block boundary in both models
NEMOTRON_P = prompt_tokens(300, 31)  # block 128: runs as 256 + 44; decoding reaches 384
QWEN_P = prompt_tokens(1200, 32)  # block 640: runs as 640 + 560; decoding reaches 1280
NEW_TEXT = prompt_tokens(40, 33)


def engine(kind: str, model, prompts, url: str | None = None, **extra) -> dict:
    spec = dict(model=str(model), prompts=prompts) if url is None else gcache_spec(model, url, prompts)
    spec.update(
        dtype=HYBRID_DTYPE[kind],
        max_tokens=DECODE,
        max_model_len=2048,
        kv_cache_bytes=32 << 20,
        engine_args=dict(block_size=None, prefix_cache_retention_interval=None),  # decode-time states
        harness_patches=["mamba2_cpu_checkpoints"] if kind == "nemotron_h" else [],
        served_model_name=kind,
        reset_between=True,  # a later prompt can only hit the store, never vLLM's own cache
    )
    spec.update(extra)
    return spec


def state_key(run: dict, kind: str, prompt: list[int], boundary: int, group: int) -> bytes:
    """The key of a state group's value at `boundary` tokens (rank 0 of 1, no namespace)."""
    counters = run["counters"]
    bs = counters["block_size"]
    state_kind, tag, segments = counters["value_tags"][str(group)]
    assert state_kind == AttentionKind.STATE
    page_hash = prompt_page_hashes(prompt, bs)[boundary // bs - 1]
    (key,) = PageKeys(kind, None, 0, 1, False).value_keys(
        page_hash, Group(group, AttentionKind.STATE, (), (), bs, 0), GroupTag(tag, segments)
    )
    return key


def hybrid_runs(kind: str, prompt: list[int], tmp_path_factory, more) -> dict:
    work = tmp_path_factory.mktemp(kind)
    model = write_hybrid(kind, work / "model")
    sock = f"{tempfile.mkdtemp(prefix='gc-vllm-')}/node.sock"  # a socket path must stay short
    server = ServerProcess(work / "store", memory="256MiB", extra_args=["--unix-socket", sock]).start()
    out: dict = {"model": model, "prompt": prompt}
    try:
        out["base"] = run_engine(engine(kind, model, [prompt]), work / "base")
        cont = prompt + out["base"]["results"][0]["tokens"] + NEW_TEXT
        out["continuation"] = cont
        # A: an empty store (misses), saves the prompt's and the decode-time states; its
        # continuation hits vLLM's own cache: the reference for B's loaded continuation.
        out["a"] = run_engine(engine(kind, model, [prompt, cont], server.address, reset_between=False), work / "a")
        out["b"] = run_engine(engine(kind, model, [prompt, cont], server.address), work / "b")
        more(out, work, model, server, sock)
        yield out
    finally:
        server.kill()


def nemotron_more(out: dict, work, model, server, sock) -> None:
    kind, prompt = "nemotron_h", out["prompt"]
    # The naive load: synchronous, in start_load_kv, after vLLM copied the boundary slot into
    # the running slot. It hits, and answers wrong: what the asynchronous state load avoids.
    out["b_sync"] = run_engine(
        engine(
            kind, model, [prompt], server.address, harness_patches=["mamba2_cpu_checkpoints", "gcache_sync_state_loads"]
        ),
        work / "b-sync",
    )
    # Another state layout (the ssm state kept in bf16): never reads the fp32 engine's states.
    out["other_layout"] = run_engine(
        engine(
            kind,
            model,
            [prompt],
            server.address,
            engine_args=dict(block_size=None, prefix_cache_retention_interval=None, mamba_ssm_cache_dtype="bfloat16"),
        ),
        work / "other-layout",
    )
    # A flipped byte of a stored state (prompt 0), then the store killed (prompt 1).
    run = EngineRun(engine(kind, model, [prompt, prompt], server.address, gates=[0, 1]), work / "damaged")
    try:
        run.wait_gate(0)
        key = state_key(out["a"], kind, prompt, 256, 0)
        flip_byte(sock, key)
        out["flipped_key"] = key
        run.open_gate(0)
        run.wait_gate(1)
        server.kill()
        run.open_gate(1)
        out["damaged"] = run.result()
    finally:
        run.kill()


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    yield from hybrid_runs("nemotron_h", NEMOTRON_P, tmp_path_factory, nemotron_more)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    yield from hybrid_runs("qwen3_next", QWEN_P, tmp_path_factory, lambda *_: None)


CASES = [("nemotron", 256, 384, ["MambaSpec", "MambaSpec", "FullAttentionSpec"]), ("qwen", 640, 1280, None)]


@pytest.mark.parametrize(("name", "prompt_hit", "continuation_hit", "groups"), CASES)
def test_fresh_engine_loads_attention_pages_and_states(request, name, prompt_hit, continuation_hit, groups):
    runs = request.getfixturevalue(name)
    base, a, b = runs["base"]["results"][0], runs["a"]["results"], runs["b"]["results"]
    if groups:
        assert runs["b"]["counters"]["kv_cache_groups"] == groups
    assert "MambaSpec" in runs["b"]["counters"]["kv_cache_groups"]
    # An empty store is a miss, and the outputs equal a run without the connector.
    assert a[0]["num_cached_tokens"] == 0 and same_output(a[0], base)
    # B: the prompt's last boundary state and the pages before it, loaded; outputs equal.
    assert b[0]["num_cached_tokens"] == prompt_hit <= len(runs["prompt"]) - 1
    assert same_output(b[0], base)
    # The continuation hits beyond the first prompt (a state saved while decoding) and answers
    # as the engine's own cache did on the same state.
    assert len(runs["prompt"]) < b[1]["num_cached_tokens"] == continuation_hit == a[1]["num_cached_tokens"]
    assert same_output(b[1], a[1])
    worker = runs["b"]["counters"]["worker"]
    assert worker["load_failed_values"] == 0 and worker["store_errors"] == 0


@pytest.mark.parametrize("name", ["nemotron", "qwen"])
def test_states_are_keyed_by_their_layout(request, name):
    runs = request.getfixturevalue(name)
    tags = runs["a"]["counters"]["value_tags"]
    states = [t for kind, t, _ in tags.values() if kind == AttentionKind.STATE]
    assert states and all(t.startswith(("mamba2-", "gdn_attn-")) for t in states)
    assert runs["a"]["counters"]["scheduler"]["state_values_offered"] >= 2 * len(states)


def test_naive_synchronous_state_load_answers_wrong(nemotron):
    """Proof that the equality above catches a load that lands after preprocess_mamba's copy."""
    sync = nemotron["b_sync"]
    assert sync["counters"]["scheduler"]["loads_sync"] == 1
    assert sync["results"][0]["num_cached_tokens"] == 256
    assert not same_output(sync["results"][0], nemotron["base"]["results"][0])


def test_another_state_layout_never_hits(nemotron):
    other, fp32 = nemotron["other_layout"], nemotron["a"]
    state_tags = lambda run: {t for k, t, _ in run["counters"]["value_tags"].values() if k == AttentionKind.STATE}  # noqa: E731
    assert state_tags(other).isdisjoint(state_tags(fp32))
    assert other["counters"]["scheduler"]["lookups"] >= 1
    assert other["counters"]["scheduler"]["hit_tokens"] == 0
    assert other["results"][0]["num_cached_tokens"] == 0


def test_a_flipped_state_byte_is_a_miss_and_a_killed_store_misses(nemotron):
    base = nemotron["base"]["results"][0]
    flipped, killed = nemotron["damaged"]["results"]
    worker = nemotron["damaged"]["counters"]["worker"]
    assert worker["corrupt_values_removed"] >= 1 and worker["load_failed_values"] >= 1
    assert flipped["num_cached_tokens"] == 0 and same_output(flipped, base)  # recomputed whole
    assert killed["num_cached_tokens"] == 0 and same_output(killed, base)
