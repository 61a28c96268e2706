"""A tiny chat model for vLLM OpenAI servers, written offline: the vLLM group's router tests
put `vllm serve` on it (and run a hybrid engine with KV events: events_run).

`write_chat_model(dir)` writes gcache.integrations.vllm.testing's tiny llama (or gemma2) plus
a real tokenizer: a byte-level BPE trained here, deterministically, on a small built-in text
(vocabulary 512, the model's), with BOS/EOS and ChatML-style special tokens and a chat
template, saved the way transformers saves any tokenizer (tokenizer.json,
tokenizer_config.json, the template). vLLM and the router then load the same files, so a
test sees what a real deployment does: text -> the model's own tokenizer and template.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the ids the tiny models' configs use for them
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A shared document that every turn of this "
    "conversation starts with. Please summarise the following text in one sentence. "
    "What is the capital of France? Paris is the capital and largest city of France. "
    "The router sends each request to the engine holding its prefix, and the engine reuses "
    "its cached key and value blocks instead of computing them again. "
    "user assistant system developer tool function image video audio "
    "0123456789 one two three four five six seven eight nine ten hello world thanks "
)


def build_tokenizer(vocab_size: int = 512):
    """A PreTrainedTokenizerFast: byte-level BPE, `vocab_size` ids, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # add_special_tokens=True (vLLM's default for completions) puts BOS first, as llama's does
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    ids = [fast.convert_tokens_to_ids(s) for s in SPECIALS[:3]]
    if ids != [PAD_ID, BOS_ID, EOS_ID] or len(fast) > vocab_size:
        raise RuntimeError(f"tokenizer layout changed: specials {ids}, {len(fast)} ids")
    return fast


def write_tokenizer(path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(path)
    return path


def write_chat_model(path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny model (gcache.integrations.vllm.testing.write_model) that `vllm serve` can run
    with its own tokenizer and chat template."""
    from gcache.integrations.vllm.testing import write_model

    path = write_model(kind, path, seed=seed, **overrides)
    write_tokenizer(path)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    gen = path / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        gen.write_text(json.dumps(g, indent=2))
    return path


def events_run(kind: str, work, steps: list) -> dict:
    """One engine (in this process) of tiny model `kind` with KV events on, over `steps`: lists
    of prompts (token ids), each step generated in order. Returns, per step, the ZMQ messages
    its events came in (base64, in order) and each prompt's num_cached_tokens: what a router
    fed those events would credit, beside what the engine really hit. Run it in a process of
    its own (python -m tests.integrations.vllm.router_models events SPEC OUT)."""
    import base64
    import os
    import threading
    import time

    from gcache.integrations.vllm.testing import BLOCK_SIZE, engine_env, write_model

    work = Path(work)
    os.environ.update(engine_env(work))
    model = write_model(kind, work / kind)
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    endpoint = f"ipc://{work}/events.sock"
    frames: list = []
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    stop = threading.Event()

    def receive():
        while not stop.is_set():
            if sub.poll(50):
                frames.append(sub.recv_multipart())

    threading.Thread(target=receive, daemon=True).start()
    llm = LLM(
        model=str(model),
        load_format="auto",
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        block_size=BLOCK_SIZE,
        seed=0,
        kv_cache_memory_bytes=16 << 20,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint),
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = []
    for prompts in steps:
        cached = []
        for p in prompts:
            (r,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
            cached.append(int(r.num_cached_tokens or 0))
        time.sleep(0.5)  # the publisher thread sends the step's batch
        got, frames[:] = list(frames), []
        out.append({"cached": cached, "frames": [[base64.b64encode(bytes(x)).decode() for x in f] for f in got]})
    stop.set()
    return {"steps": out}


if __name__ == "__main__":
    import os
    import sys

    if sys.argv[1:2] == ["events"]:
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(events_run(spec["kind"], spec["work"], spec["steps"])))
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's slow teardown: the result is written
    raise SystemExit("usage: python -m tests.integrations.vllm.router_models events SPEC.json OUT.json")
