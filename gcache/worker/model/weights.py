"""Model weights: deterministic from a seed, or loaded from .npz / safetensors.

The tensor layout (names, shapes, orientation y = x @ W) is documented in
docs/worker-weights.md. The safetensors header is parsed here with json + numpy,
so no extra dependency is needed.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from gcache.worker.config import ModelConfig

CONFIG_KEY = "gcache_config"  # safetensors __metadata__ key / npz array name
HEADER_BYTES_MAX = 100 * 1024 * 1024  # refuse absurd headers instead of reading them
_ST_DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2")}
_ST_NAMES: dict[np.dtype[Any], str] = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<f2"): "F16"}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, in the canonical (and seeded-init) order."""
    h = cfg.hidden
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, h)}
    for i in range(cfg.layers):
        shapes.update(block_shapes(cfg, f"layers.{i}."))
    shapes["final_norm.weight"] = (h,)
    shapes["lm_head.weight"] = (h, cfg.vocab_size)
    for d in range(cfg.mtp_layers):  # after the main model's, so its seeded init is unchanged
        p = f"mtp.{d}."
        shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "proj": (2 * h, h)})
        shapes.update(block_shapes(cfg, p))
        shapes[p + "final_norm.weight"] = (h,)
    return shapes


def block_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One transformer block's tensors under prefix p (a main layer or an MTP block)."""
    h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return dict(
        {
            p + "attn_norm.weight": (h,),
            p + "attn.wq": (h, q),
            p + "attn.wk": (h, kv),
            p + "attn.wv": (h, kv),
            p + "attn.wo": (q, h),
            p + "mlp_norm.weight": (h,),
            p + "mlp.w_gate": (h, cfg.intermediate),
            p + "mlp.w_up": (h, cfg.intermediate),
            p + "mlp.w_down": (cfg.intermediate, h),
        }
    )


def init_weights(cfg: ModelConfig, seed: int | None = None) -> dict[str, np.ndarray]:
    """Seeded init, drawn in float64 then cast, so float32 and float64 models share weights."""
    rng = np.random.default_rng(cfg.seed if seed is None else seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "embed.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[0])
        out[name] = w.astype(cfg.dtype)
    return out


def validate(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Check names and shapes against the layout; return arrays cast to cfg.dtype."""
    expected = weight_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(f"weights do not match the layout: missing {missing[:5]}, unexpected {extra[:5]}")
    out = {}
    for name, shape in expected.items():
        a = np.asarray(weights[name])
        if a.shape != shape:
            raise ValueError(f"weight {name} has shape {a.shape}, expected {shape}")
        if a.dtype.kind != "f":
            raise ValueError(f"weight {name} has dtype {a.dtype}, expected a float type")
        out[name] = a.astype(cfg.dtype, copy=False)
    return out


# ---- .npz -------------------------------------------------------------------
def save_npz(path: str | os.PathLike, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    weights = validate(cfg, weights)
    meta = np.frombuffer(cfg.to_json().encode(), dtype=np.uint8)
    # numpy's stub: a **dict could name savez's allow_pickle; these names never do (validate)
    np.savez(path, **{CONFIG_KEY: meta}, **weights)  # type: ignore[arg-type]


def load_npz(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    with np.load(path, allow_pickle=False) as z:
        if CONFIG_KEY not in z.files:
            raise ValueError(f"{path}: no {CONFIG_KEY!r} entry (not a gcache weights file)")
        cfg = ModelConfig.from_json(bytes(z[CONFIG_KEY]).decode())
        weights = {k: z[k] for k in z.files if k != CONFIG_KEY}
    return cfg, validate(cfg, weights)


# ---- safetensors -------------------------------------------------------------
def save_safetensors(path: str | os.PathLike, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    weights = validate(cfg, weights)
    header: dict = {"__metadata__": {CONFIG_KEY: cfg.to_json()}}
    offset = 0
    for name, a in weights.items():
        dt = a.dtype.newbyteorder("<")
        header[name] = {"dtype": _ST_NAMES[dt], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data buffer 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in weights.values():
            f.write(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse any safetensors file into (tensors, metadata); F32/F64/F16/BF16 supported."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(HEADER_BYTES_MAX, size - 8):
            raise ValueError(f"{path}: safetensors header length {n} exceeds the file or the limit")
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    meta = header.pop("__metadata__", {}) if isinstance(header, dict) else {}
    tensors, spans = {}, []
    if not isinstance(header, dict) or not isinstance(meta, dict):
        raise ValueError(f"{path}: safetensors header must be a JSON object")
    for name, info in header.items():
        try:
            begin, end = (int(o) for o in info["data_offsets"])
            shape = tuple(int(s) for s in info["shape"])
            dt_name = info["dtype"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: malformed header entry for tensor {name!r}: {e}") from None
        if not 0 <= begin <= end <= data.size:
            raise ValueError(f"{path}: tensor {name} offsets {begin}..{end} out of the data buffer")
        itemsize = 2 if dt_name == "BF16" else _ST_DTYPES.get(dt_name, np.dtype("V1")).itemsize
        if dt_name not in _ST_DTYPES and dt_name != "BF16":
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dt_name}")
        if end - begin != int(np.prod(shape, dtype=np.int64)) * itemsize:
            raise ValueError(f"{path}: tensor {name} byte length does not match shape {shape}")
        spans.append((begin, end, name))
        buf = np.asarray(data[begin:end])
        if dt_name == "BF16":  # bfloat16 = the high half of a float32
            a = (buf.view("<u2").astype(np.uint32) << 16).view("<f4")
        else:
            a = buf.view(_ST_DTYPES[dt_name])
        tensors[name] = a.reshape(shape).copy()
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {n0} and {n1} overlap")
    return tensors, meta


def load_safetensors(
    path: str | os.PathLike, cfg: ModelConfig | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    tensors, meta = read_safetensors(path)
    if cfg is None:
        if CONFIG_KEY not in meta:
            raise ValueError(f"{path}: no {CONFIG_KEY!r} in __metadata__; pass a ModelConfig")
        cfg = ModelConfig.from_json(meta[CONFIG_KEY])
    return cfg, validate(cfg, tensors)


def load(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Load by extension: .npz or .safetensors."""
    p = str(path)
    if p.endswith(".npz"):
        return load_npz(p)
    if p.endswith(".safetensors"):
        return load_safetensors(p)
    raise ValueError(f"unknown weights format for {p!r}: use .npz or .safetensors")
