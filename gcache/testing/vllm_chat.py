"""A tiny chat model for vLLM OpenAI servers, written offline: the vLLM group's router tests
and bench/router/vllm_trace.py put `vllm serve` on it.

`write_chat_model(dir)` writes testing.py's tiny llama (or gemma2) plus a real tokenizer: a
byte-level BPE trained here, deterministically, on a small built-in text (vocabulary 512, the
model's), with BOS/EOS and ChatML-style special tokens and a chat template, saved the way
transformers saves any tokenizer (tokenizer.json, tokenizer_config.json, the template). vLLM
and the router then load the same files, so a test or a bench sees what a real deployment
does: text -> the model's own tokenizer and template. Not used by the connector itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A shared document that every turn of this "
    "conversation starts with. Please summarise the following text in one sentence. "
    "What is the capital of France? Paris is the capital and largest city of France. "
    "The router sends each request to the engine holding its prefix, and the engine reuses "
    "its cached key and value blocks instead of computing them again. "
    "user assistant system developer tool function image video audio "
    "0123456789 one two three four five six seven eight nine ten hello world thanks "
)


def build_tokenizer(vocab_size: int = 512) -> Any:  # transformers.PreTrainedTokenizerFast
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
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
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


def write_tokenizer(where: str | Path) -> Path:
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(path)
    return path


def write_chat_model(where: str | Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A tiny model (gcache.testing.vllm_models.write_model) that `vllm serve` can run
    with its own tokenizer and chat template."""
    from gcache.testing.vllm_models import write_model

    path = write_model(kind, where, seed=seed, **overrides)
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
