"""Model and cache geometry of the hybrid sliding-window-attention model."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from gcache.common.attention import AttentionKind

DTYPES = ("float32", "float64")
MTP_LAYERS_MAX = 3


def hybrid_pattern(layers: int, swa_per_full: int = 6) -> tuple[str, ...]:
    """1 full layer after every `swa_per_full` SWA layers: index % 7 == 6 -> full."""
    period = swa_per_full + 1
    return tuple(AttentionKind.FULL if i % period == period - 1 else AttentionKind.SWA for i in range(layers))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    hidden: int = 256
    layers: int = 14
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 512
    window: int = 128
    layer_pattern: tuple[str, ...] = field(default=())  # () -> hybrid_pattern(layers)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    page_size: int = 16
    dtype: str = "float32"
    seed: int = 0
    mtp_layers: int = 0  # multi-token-prediction blocks in the weights (model/mtp.py), 0..MTP_LAYERS_MAX

    def __post_init__(self) -> None:
        if not self.layer_pattern:
            object.__setattr__(self, "layer_pattern", hybrid_pattern(self.layers))
        object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))
        for name in (
            "vocab_size",
            "hidden",
            "layers",
            "heads",
            "kv_heads",
            "head_dim",
            "intermediate",
            "window",
            "page_size",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if len(self.layer_pattern) != self.layers:
            raise ValueError(f"layer_pattern has {len(self.layer_pattern)} entries, expected {self.layers}")
        bad = [k for k in self.layer_pattern if k not in (AttentionKind.FULL, AttentionKind.SWA)]
        if bad:
            raise ValueError(f"layer_pattern entries must be 'full' or 'swa', got {bad[0]!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.mtp_layers, int) or not 0 <= self.mtp_layers <= MTP_LAYERS_MAX:
            raise ValueError(f"ModelConfig.mtp_layers must be an int in [0, {MTP_LAYERS_MAX}], got {self.mtp_layers!r}")
        if self.vocab_size < 259:
            raise ValueError("vocab_size must be >= 259 (256 bytes + 3 special ids)")

    # ---- presets -------------------------------------------------------------
    @classmethod
    def small(cls, **kw: Any) -> ModelConfig:
        return cls(**kw)

    @classmethod
    def large(cls, **kw: Any) -> ModelConfig:
        """A production-shaped layout (70 layers: 10 full + 60 SWA), for GPU runs."""
        base: dict[str, Any] = dict(
            vocab_size=32000, hidden=1024, layers=70, heads=16, kv_heads=4, head_dim=64, intermediate=2816, window=128
        )
        base.update(kw)
        return cls(**base)

    def all_full(self) -> ModelConfig:
        """The same model with full attention in every layer (KV comparison baseline)."""
        return dataclasses.replace(self, layer_pattern=(AttentionKind.FULL,) * self.layers)

    def all_swa(self) -> ModelConfig:
        return dataclasses.replace(self, layer_pattern=(AttentionKind.SWA,) * self.layers)

    def with_dtype(self, dtype: str) -> ModelConfig:
        return dataclasses.replace(self, dtype=dtype)

    # ---- derived -------------------------------------------------------------
    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_pattern) if k == AttentionKind.FULL)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_pattern) if k == AttentionKind.SWA)

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 8

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["layer_pattern"] = list(self.layer_pattern)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        d["layer_pattern"] = tuple(d.get("layer_pattern", ()))
        return cls(**d)
