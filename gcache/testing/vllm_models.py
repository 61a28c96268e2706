"""Tiny local models and a one-shot engine run, for the vLLM group's tests and benches (not
used by the connector itself).

`write_model(kind, dir)` writes a config.json plus seeded random safetensors weights (not
vLLM's load_format="dummy", whose near-zero weights make the output ignore the KV):
"llama" (full attention), "gemma2" (alternating sliding/full, window 32), "mistral" (every
layer sliding, window 32); "llava" is vllm_mm.write_llava (a tiny multimodal model).
`python -m gcache.testing.vllm_models SPEC.json OUT.json` runs one engine process
(single-process mode, loopback only) over the spec's prompts and writes tokens, logprobs,
cached-token counts and the connectors' counters (the KV connector's and the encoder
cache's: a spec may configure either or both). A spec with "busy" ({"count", "tokens",
"max_tokens", "warm_steps", "seed"}) times each prompt while that many other requests decode;
"together": true runs all prompts in one generate call (a small KV cache preempts some);
"abort_prompts": [i, ...] adds prompt i and aborts it at once (its result: {"aborted": true}).

Multimodal specs ("mm": true) have prompts {"text": "w1 <image> w2", "images": [IMAGE...]}
(IMAGE: {"seed": s} noise from vllm_mm.image, or {"file": path} a PIL image read from a
file) or {"text": ..., "urls": [url...]} (served through LLM.chat, vLLM's media loader:
file:// under spec["media_dir"], data: URLs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

WINDOW = 32  # the sliding window of the hybrid and all-sliding models (one block of 32)
BLOCK_SIZE = 32  # vLLM's CPU attention wants block_size % 32 == 0
VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # CPU attention takes 32, 64, 80, ...; not 16
    max_position_embeddings=8192,
)


def model_config(kind: str, layers: int = 2, **overrides: Any) -> Any:  # a transformers config
    import transformers

    common = {**_COMMON, **overrides}
    if kind == "llama":
        return transformers.LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **common)
    if kind == "gemma2":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return transformers.Gemma2Config(
            num_hidden_layers=layers, sliding_window=WINDOW, layer_types=layer_types, **common
        )
    if kind == "mistral":
        return transformers.MistralConfig(
            num_hidden_layers=layers, sliding_window=WINDOW, tie_word_embeddings=False, **common
        )
    raise ValueError(f"unknown tiny model kind {kind!r} (llama, gemma2, mistral)")


def write_model(kind: str, where: str | Path, *, layers: int | None = None, seed: int = 0, **overrides: Any) -> Path:
    """A tiny model with seeded random weights (std 0.2; Gemma2's tied embeddings 0.05) in `path`.
    kind "llava" (or "llava-mistral", "llava-gemma2"): vllm_mm.write_llava."""
    if kind.startswith("llava"):  # overrides: write_llava's (image_size, vision_hidden, vision_layers)
        from gcache.testing.vllm_mm import TEXT_WIDTH, write_llava

        text = kind.partition("-")[2] or "llama"
        text_config = model_config(text, layers or 2, hidden_size=TEXT_WIDTH)
        return write_llava(where, text_config, text=text, seed=seed, **overrides)
    import torch
    import transformers

    path = Path(where)
    cfg = model_config(kind, layers or (4 if kind == "gemma2" else 2), **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                std = 0.05 if (kind == "gemma2" and "embed" in name) else 0.2
                param.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    (path / "params.txt").write_text(str(sum(p.numel() for p in model.parameters())))
    return path


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    """A reproducible prompt of n token ids in [1, VOCAB)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def engine_env(work: Path) -> dict[str, str]:
    """The environment of an engine process: single-process, loopback only, out of /tmp.

    vLLM's cache root is shared by every run of this venv: it holds the model inspection
    vLLM otherwise redoes in a subprocess per start (half a minute on a loaded machine)."""
    env = dict(os.environ)
    cache_root = Path(os.environ.get("GCACHE_VLLM_CACHE_ROOT", Path(sys.prefix) / "gcache-vllm-cache"))
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_RPC_BASE_PATH=str(work / "rpc"),
        VLLM_CACHE_ROOT=str(cache_root),
        VLLM_CPU_OMP_THREADS_BIND="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TMPDIR=str(work / "tmp"),
        OMP_NUM_THREADS="1",
    )
    for sub in ("rpc", "tmp"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    from gcache.testing.vllm_mm import write_shim

    shim = write_shim(work / "pyshim")  # vLLM's LLaVA without torchvision (vllm_mm)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    return env


def _flush_saves() -> None:
    """Waits for the connectors' queued saves: main() exits without vLLM's shutdown."""
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group() and hasattr(get_kv_transfer_group(), "flush"):
        get_kv_transfer_group().flush()
    if has_ec_transfer() and hasattr(get_ec_transfer(), "flush"):
        get_ec_transfer().flush()


def _ec_counters(llm: Any) -> dict[str, Any]:  # llm: vllm.LLM
    """The encoder cache connector's counters, both sides (single-process engine only)."""
    out: dict[str, Any] = {}
    try:
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

        if has_ec_transfer() and hasattr(get_ec_transfer(), "counters"):
            out["worker"] = get_ec_transfer().counters()
            out["saved_keys"] = [k.decode() for k in get_ec_transfer().recent_saved_keys()]
        conn = llm.llm_engine.engine_core.engine_core.scheduler.ec_connector
        if conn is not None and hasattr(conn, "counters"):
            out["scheduler"] = conn.counters()
    except Exception as exc:  # the counters are a report, not the test's subject
        out["error"] = repr(exc)
    return out


def _connector_counters(llm: Any) -> dict[str, Any]:
    """The GCache connector's counters on both sides (single-process engine only)."""
    out: dict[str, Any] = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker = get_kv_transfer_group()
            if hasattr(worker, "counters"):
                out["worker"] = worker.counters()
    except Exception as exc:  # the counters are a report, not the test's subject
        out["worker_error"] = repr(exc)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        conn = scheduler.connector
        if conn is not None and hasattr(conn, "counters"):
            out["scheduler"] = conn.counters()
        side = getattr(conn, "scheduler_side", None)
        if side is not None and side.tags is not None:  # what the workers' handshake named
            out["value_tags"] = {str(g): [side.groups[g].kind, t.tag, t.segments] for g, t in side.tags.items()}
        if side is not None:
            out["block_size"] = side.block_size  # hybrids: what vLLM forced it up to
        groups = scheduler.kv_cache_config.kv_cache_groups
        out["kv_cache_groups"] = [type(g.kv_cache_spec).__name__ for g in groups]
    except Exception as exc:
        out["scheduler_error"] = repr(exc)
    return out


GATE_TIMEOUT_S = 300.0
RESET_STEPS_MAX = 50


def _reset_prefix_cache(llm: Any) -> None:
    """Empties vLLM's prefix cache. A finished request whose saves a connector waits for
    holds its blocks until the engine's next step reports them saved, so step (bounded)."""
    for _ in range(RESET_STEPS_MAX):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()
        time.sleep(0.02)
    raise RuntimeError(f"vLLM's prefix cache still in use after {RESET_STEPS_MAX} steps")


def _gate(gate_dir: Path, i: int) -> None:
    """Says "ready-i", then waits (bounded) for the test's "go-i": the test changes the store
    between two prompts of one engine (corrupts a page, kills the server)."""
    (gate_dir / f"ready-{i}").write_text("")
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not (gate_dir / f"go-{i}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go-{i} in {gate_dir} after {GATE_TIMEOUT_S:.0f}s")
        time.sleep(0.05)


def _reset_encoder_cache(llm: Any) -> None:
    """Empties vLLM's encoder cache (scheduler and worker): the next prompt's items are
    encoded or loaded as in a fresh engine."""
    llm.llm_engine.reset_encoder_cache()
    llm.reset_mm_cache()


def _mm_request(llm: Any, prompt: dict[str, Any], params: Any, spec: dict[str, Any]) -> Any:
    """One multimodal prompt: generate() with PIL images, or chat() with image URLs."""
    from PIL import Image

    from gcache.testing.vllm_mm import image

    if "urls" in prompt:
        content = [{"type": "image_url", "image_url": {"url": u}} for u in prompt["urls"]]
        content.append({"type": "text", "text": prompt["text"]})
        return llm.chat(
            [{"role": "user", "content": content}],
            params,
            use_tqdm=False,
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
            chat_template_content_format="string",
            add_generation_prompt=False,
        )
    images = []
    for item in prompt.get("images", ()):
        if "file" in item:
            with Image.open(item["file"]) as f:
                images.append(f.convert("RGB"))
        else:
            images.append(image(item["seed"]))
    request = {"prompt": prompt["text"]}
    if images:
        request["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    return llm.generate([request], params, use_tqdm=False)


BUSY_STEPS_MAX = 100_000  # a busy run's steps at most (each background request decodes its tokens)


def _generate_busy(llm: Any, prompt: list[int], params: Any, busy: dict[str, Any], tag: str) -> tuple[Any, float]:
    """One prompt while busy["count"] other requests decode: they are added and stepped
    busy["warm_steps"] times (prefilled, decoding) first; the prompt's seconds run from its
    arrival to its output. The background requests are aborted after it (bounded steps)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    background = SamplingParams(temperature=0, max_tokens=busy.get("max_tokens", 1024), ignore_eos=True)
    ids = [f"busy-{tag}-{i}" for i in range(busy.get("count", 8))]
    seed = busy.get("seed", 1000)
    for i, rid in enumerate(ids):
        engine.add_request(
            rid, TokensPrompt(prompt_token_ids=prompt_tokens(busy.get("tokens", 64), seed + i)), background
        )
    for _ in range(busy.get("warm_steps", 4)):
        engine.step()
    hit_id = f"hit-{tag}"
    t0 = time.perf_counter()
    engine.add_request(hit_id, TokensPrompt(prompt_token_ids=prompt), params)
    out = None
    for _ in range(BUSY_STEPS_MAX):
        for o in engine.step():
            if o.request_id == hit_id and o.finished:
                out = o
        if out is not None:
            break
    seconds = time.perf_counter() - t0
    if out is None:
        raise RuntimeError(f"the prompt did not finish in {BUSY_STEPS_MAX} steps")
    engine.abort_request(ids)
    for _ in range(BUSY_STEPS_MAX):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    return out, seconds


def _result(out: Any, seconds: float) -> dict[str, Any]:  # out: vllm.RequestOutput
    comp = out.outputs[0]
    return dict(
        tokens=list(comp.token_ids),
        logprobs=[sorted([[int(t), float(lp.logprob)] for t, lp in step.items()]) for step in (comp.logprobs or [])],
        num_cached_tokens=int(out.num_cached_tokens or 0),
        num_prompt_tokens=len(out.prompt_token_ids or ()),
        seconds=seconds,
    )


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine over spec["prompts"] (one generate call each, in order)."""
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if spec.get("connector"):
        kv = KVTransferConfig(
            kv_connector=spec["connector"],
            kv_connector_module_path=spec.get("module_path"),
            kv_role=spec.get("kv_role", "kv_both"),
            kv_connector_extra_config=spec.get("extra_config", {}),
        )
    ec = None
    if spec.get("ec_connector"):
        ec = ECTransferConfig(
            ec_connector=spec["ec_connector"],
            ec_connector_module_path=spec.get("ec_module_path"),
            ec_role=spec.get("ec_role", "ec_both"),
            ec_connector_extra_config=spec.get("ec_extra_config", {}),
        )
    mm = bool(spec.get("mm"))
    mm_args = {}
    if mm:
        mm_args = dict(
            limit_mm_per_prompt={"image": spec.get("images_max", 2)},
            allowed_local_media_path=spec.get("media_dir", ""),
        )
    if spec.get("served_model_name"):
        mm_args["served_model_name"] = spec["served_model_name"]
    if spec.get("kv_events"):  # vLLM's own KV events (e.g. {"endpoint": "ipc:///tmp/vllm.kv"})
        from vllm.config import KVEventsConfig

        mm_args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **spec["kv_events"])
    if spec.get("harness_patches"):  # vllm_hybrid_models: test-harness patches, before the engine starts
        from gcache.testing.vllm_hybrid_models import apply_harness_patches

        apply_harness_patches(spec["harness_patches"])
    engine_args = dict(spec.get("engine_args", {}))  # e.g. prefix_cache_retention_interval
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        load_format="auto",
        skip_tokenizer_init=not mm,
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        block_size=engine_args.pop("block_size", BLOCK_SIZE),  # None: vLLM's (hybrids force it up)
        seed=0,
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        distributed_executor_backend="uni",
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_transfer_config=kv,
        ec_transfer_config=ec,
        **mm_args,
        **engine_args,
    )
    init_s = time.perf_counter() - started
    params = SamplingParams(
        temperature=0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, logprobs=spec.get("logprobs", 3)
    )
    results = []
    gates = set(spec.get("gates", ()))
    if spec.get("batches"):  # [[prompt index, ...], ...]: each list one generate call, in order
        for batch in spec["batches"]:
            t0 = time.perf_counter()
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in batch], params, use_tqdm=False
            )
            results += [_result(out, time.perf_counter() - t0) for out in outs]
        _flush_saves()
        return dict(results=results, init_s=init_s, counters=_connector_counters(llm))
    if spec.get("together"):  # one batch: the engine schedules them side by side
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        results = [_result(out, seconds) for out in outs]
        _flush_saves()
        return dict(results=results, init_s=init_s, counters=_connector_counters(llm))
    aborted = set(spec.get("abort_prompts", ()))
    for i, prompt in enumerate(spec["prompts"]):
        if i in gates:
            _gate(Path(spec["gate_dir"]), i)
        if i and spec.get("reset_between"):  # the next prompt cannot hit vLLM's own prefix cache
            _reset_prefix_cache(llm)
            if mm:  # nor its encoder cache
                _reset_encoder_cache(llm)
        if i in aborted:  # arrives (the connector's on_new_request) and is aborted before a step
            llm.llm_engine.add_request(f"aborted-{i}", TokensPrompt(prompt_token_ids=prompt), params)
            llm.llm_engine.abort_request([f"aborted-{i}"])
            results.append(dict(aborted=True))
            continue
        t0 = time.perf_counter()
        if spec.get("busy"):  # other requests decode while this prompt arrives
            out, seconds = _generate_busy(
                llm, prompt, params, dict(spec["busy"], seed=spec["busy"].get("seed", 1000) + 100 * i), str(i)
            )
        elif mm:
            (out,) = _mm_request(llm, prompt, params, spec)
            seconds = time.perf_counter() - t0
        else:
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        results.append(_result(out, seconds))
        if ec is not None:  # per prompt, after its saves landed: what the encoder cache did (cumulative)
            _flush_saves()
            results[-1]["ec"] = _ec_counters(llm)
    _flush_saves()
    counters = _connector_counters(llm)
    if ec is not None:
        counters["ec"] = _ec_counters(llm)
    return dict(results=results, init_s=init_s, counters=counters)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result))
    # Skip vLLM's slow teardown of a single-process engine: the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
