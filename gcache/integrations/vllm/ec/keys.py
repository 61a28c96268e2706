"""Store keys of encoder outputs: one value per multimodal item (value.py).

    [namespace "/"] item ".ec-" modality "-" dtype "w" width "-e" encoder "_" model

- item: vLLM's item identifier (`mm_feature.identifier`, the `mm_hash`): its content hash of
  the media (the decoded pixels, or the original bytes of media fetched from a URL or file),
  the media and processor kwargs, the model string (`--model`) and, with LoRA, the adapter
  name. A hex hash is used as is; anything else (a client's `multi_modal_uuids` value, a
  LoRA prefix) as "u" + its sha256, so every key is key-safe and bounded.
- modality, dtype, width: the encoder output's (width: its last dimension, which can exceed
  the LM's hidden size);
- encoder: 8 hex digits of vLLM's multimodal config hash (encoder attention backend and dtype,
  encoder TP mode, ...): engines whose encoders compute differently never share;
- model: `gcache_model`, else vLLM's served model name (`--served-model-name`), else the model
  string; characters outside [A-Za-z0-9._-] become '-'.

The item identifier embeds the model *string* vLLM was started with (a path or a hub id), so
engines share embeddings only when started with the same `--model` string (the same mount
point or hub id), or when clients name items themselves with `multi_modal_uuids` (then the
key's model part alone keeps models apart). Engines started from different paths never hit
each other's items: misses, never wrong embeddings.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

from gcache.integrations.vllm.kv.keys import model_tag
from gcache.wire.protocol import KEY_BYTES_MAX

_HEX_ID = re.compile(r"^[0-9a-f]{32,128}$")
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def item_part(identifier: str) -> str:
    """The key's item part: vLLM's hex hashes as they are, anything else hashed ('u' + sha256:
    never a hex hash, so never another item's key)."""
    if _HEX_ID.match(identifier):
        return identifier
    return "u" + hashlib.sha256(identifier.encode("utf-8", "surrogatepass")).hexdigest()


def encoder_tag(encoder_hash: str | None) -> str:
    return _BAD.sub("", encoder_hash or "")[:8] or "0"


class ItemSpec(NamedTuple):
    """What one item's value must be: its key, dtype, rows (embeddings) and width."""

    key: bytes
    dtype: str
    rows: int
    width: int


class ItemKeys:
    """The keys of one engine's items. widths: modality -> encoder output width (measured
    by vLLM on producers); default_width: the width of other modalities (the LM's input
    embedding size)."""

    def __init__(
        self,
        model: str,
        namespace: str | None,
        dtype: str,
        widths: dict[str, int],
        default_width: int,
        encoder_hash: str | None = None,
    ):
        self.model = model_tag(model)
        self.prefix = f"{namespace}/" if namespace else ""
        self.dtype = dtype
        self.widths = dict(widths)
        self.default_width = int(default_width)
        self.encoder = encoder_tag(encoder_hash)

    def width(self, modality: str) -> int:
        return int(self.widths.get(modality, self.default_width))

    def key(self, identifier: str, modality: str) -> bytes:
        tag = _BAD.sub("-", modality) or "mm"
        raw = (
            f"{self.prefix}{item_part(identifier)}.ec-{tag}-{self.dtype}w{self.width(modality)}"
            f"-e{self.encoder}_{self.model}"
        ).encode("ascii")
        if len(raw) > KEY_BYTES_MAX:
            raise ValueError(f"encoder-output key of {len(raw)} bytes exceeds {KEY_BYTES_MAX}: shorten the namespace")
        return raw

    def spec(self, identifier: str, modality: str, rows: int) -> ItemSpec:
        return ItemSpec(self.key(identifier, modality), self.dtype, int(rows), self.width(modality))
