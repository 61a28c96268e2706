"""vLLM's KV cache groups as the connector sees them: a pool kind ("full", "swa" or "state"),
the layers, for a sliding-window group the pages it needs before a cut, and for a state group
(MambaSpec: Mamba, Mamba2, gated delta net) what its bytes depend on (state_groups.py).

vLLM gives each group its own block table; with the hybrid allocator (HMA) a Gemma2-style
model has a SlidingWindowSpec group and a FullAttentionSpec group whose layers share one
tensor pool, a Qwen3-Next or Nemotron-H model MambaSpec groups beside its attention group. A
group of any other kind (chunked-local, cross-attention, encoder-only, ...) is an error at
startup naming it: the connector cannot say which of its pages resume a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv.plan import sliding_tail_pages
from gcache.integrations.vllm.kv.state_groups import StateSpec, state_spec_of

if TYPE_CHECKING:  # vLLM's type: Any to the type check (not installed in .venv)
    from vllm.v1.kv_cache_interface import KVCacheConfig


# vLLM 0.32's KV cache spec kinds the connector refuses (named in the error).
UNSUPPORTED = (
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
)


class GroupError(ValueError):
    """A KV cache layout the connector cannot serve (the message says what to change)."""


class Group(NamedTuple):
    # The field shadows tuple.index(), which mypy reports; the name is the connector's word for
    # vLLM's group number (kept: the tests and the sides use it).
    index: int  # type: ignore[assignment]  # shadows tuple.index (above)
    kind: AttentionKind
    layer_names: tuple[str, ...]
    layer_ids: tuple[int, ...]  # the model's layer numbers: the key's "@g" part
    block_size: int
    tail: int  # sliding-window groups: pages needed before a cut; 0 for full attention
    spec_kind: str = ""  # vLLM's KVCacheSpecKind value (what its KV events call the group)
    window: int | None = None  # a sliding-window group's window, in tokens
    state: StateSpec | None = None  # a state group's: what its bytes depend on


def _layer_id(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))


def required(kv_cache_config: KVCacheConfig | None) -> KVCacheConfig:
    if kv_cache_config is None:
        raise GroupError("GCacheConnector needs vLLM's kv_cache_config (vLLM 0.32 or newer)")
    return kv_cache_config


def groups_of(kv_cache_config: KVCacheConfig | None) -> list[Group]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        get_kv_cache_spec_kind,
    )

    kv_cache_config = required(kv_cache_config)
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        state = None
        if isinstance(spec, SlidingWindowSpec):
            kind, tail = AttentionKind.SWA, sliding_tail_pages(spec.sliding_window, spec.block_size)
        elif isinstance(spec, FullAttentionSpec):  # MLA too; a windowed spec without HMA keeps all KV
            kind, tail = AttentionKind.FULL, 0
        elif isinstance(spec, MambaSpec):
            kind, tail, state = AttentionKind.STATE, 0, state_spec_of(spec)
        else:
            raise GroupError(
                f"KV cache group {index} is {type(spec).__name__}, which GCacheConnector does not serve "
                f"(unsupported: {', '.join(UNSUPPORTED)}); it serves full-attention, sliding-window "
                "attention and Mamba / linear-attention state (MambaSpec) groups"
            )
        names = tuple(group.layer_names)
        groups.append(
            Group(
                index=index,
                kind=kind,
                layer_names=names,
                layer_ids=tuple(_layer_id(n) for n in names),
                block_size=spec.block_size,
                tail=tail,
                spec_kind=str(get_kv_cache_spec_kind(spec).value),
                window=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
                state=state,
            )
        )
    sizes = {g.block_size for g in groups}
    if len(sizes) != 1:
        raise GroupError(f"KV cache groups with different block sizes {sorted(sizes)} are not supported")
    return groups
