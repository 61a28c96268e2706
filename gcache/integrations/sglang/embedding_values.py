"""How the embedding store names and lays out SGLang's multimodal embeddings in GCache (no torch,
no sglang: the unit lane tests it).

One item (an image, a clip, an audio segment: one entry of SGLang's embedding cache) is one
header value plus its payload: the embedding's rows, in one value, or in segments of
SEGMENT_BYTES when larger (a long video). Keys, ASCII:

    [namespace "/"] "emb1." content "." dtype "x" width "_" model "." part

- content: SGLang's item hash (`MultimodalDataItem.hash`, a hash of the *preprocessed* tensor,
  as a decimal string) when it is 1-128 of [A-Za-z0-9_-]; anything else is "~" + its sha256;
- dtype, width: the embedding's element type (torch's name: bfloat16, float16, float32, ...) and
  row width (the encoder's output dim), both from the pool tensor SGLang registers;
- model: the model identity (the `gcache_model` setting; else SGLang's served model name) with
  characters outside [A-Za-z0-9._-] as '-' (long names: a prefix and a hash);
- part: "h" (the header) or "d0", "d1", ... (the payload's segments);
- "emb1": the format version; another format never reads these values.

The header (HEADER_BYTES) names the format, dtype, shape (rows, width), payload and segment
sizes, and a digest of the item's key. A reader checks it against what it expects before it
trusts the payload: a header that disagrees is a miss (see `Header.check`), never bytes read
as another dtype or shape. Every value is checksummed by the client (verify_checksums).
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import NamedTuple

from gcache.wire.protocol import KEY_BYTES_MAX

FORMAT = "emb1"
SEGMENT_BYTES = 16 << 20  # payload bytes per value; the node's --value-bytes-max must allow it
MODEL_NAME_MAX = 96
CONTENT_MAX = 128
PART_HEADER = "h"

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_BAD = re.compile(r"[^A-Za-z0-9._-]+")
_CONTENT = re.compile(rf"^[A-Za-z0-9_-]{{1,{CONTENT_MAX}}}$")
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,15}$")


class EmbeddingFormatError(ValueError):
    """A name, a header or a layout the embedding store cannot use (the message says why)."""


def model_tag(name: str) -> str:
    """The model identity as a key field."""
    if not isinstance(name, str) or not name.strip():
        raise EmbeddingFormatError(f"the model identity must be a non-empty string, got {name!r}")
    tag = _BAD.sub("-", name.strip()).strip("-") or "model"
    if len(tag) > MODEL_NAME_MAX:
        tag = tag[: MODEL_NAME_MAX - 17] + "-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return tag


def content_tag(mm_hash: object) -> str:
    """SGLang's item hash as a key field: as is when short and plain, else "~" + its sha256
    ('~' never appears in a plain one, so two hashes never share a field)."""
    text = str(mm_hash)
    if _CONTENT.match(text):
        return text
    return "~" + hashlib.sha256(text.encode()).hexdigest()


def dtype_tag(dtype: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if not _DTYPE.match(name):
        raise EmbeddingFormatError(f"dtype {dtype!r} is not a dtype name (bfloat16, float16, float32, ...)")
    return name


class EmbeddingKeys:
    """Keys of one deployment's items: `base(content, dtype, width)` names an item; `parts`
    lists its header key and its payload keys."""

    def __init__(self, model: str, namespace: str | None = None):
        if namespace is not None and not _NAME.match(namespace):
            raise EmbeddingFormatError(f"namespace {namespace!r} may only use letters, digits, '.', '_' and '-'")
        self.model = model_tag(model)
        self.namespace = namespace
        self._prefix = (namespace + "/" if namespace else "") + FORMAT + "."
        # The longest key this deployment can make must fit the protocol's key limit.
        longest = self.base("~" + "0" * 64, "float8_e4m3fnuz", 1 << 40) + ".d99999"
        if len(longest) > KEY_BYTES_MAX:
            raise EmbeddingFormatError(
                f"keys of up to {len(longest)} bytes exceed {KEY_BYTES_MAX}: shorten gcache_namespace"
            )

    def item_prefix(self, mm_hash: object) -> str:
        return f"{self._prefix}{content_tag(mm_hash)}."

    def base(self, mm_hash: object, dtype: str, width: int) -> str:
        if not isinstance(width, int) or width < 1:
            raise EmbeddingFormatError(f"width must be an int >= 1, got {width!r}")
        return f"{self.item_prefix(mm_hash)}{dtype_tag(dtype)}x{width}_{self.model}"

    def header_key(self, base: str) -> bytes:
        return f"{base}.{PART_HEADER}".encode("ascii")

    def data_keys(self, base: str, segments: int) -> list[bytes]:
        return [f"{base}.d{i}".encode("ascii") for i in range(segments)]

    def probe_keys(self, base: str) -> list[bytes]:
        """What an existence check asks for: the header and the first payload segment (an item
        whose later segments were evicted reads as a miss, and the encoder runs)."""
        return [self.header_key(base), f"{base}.d0".encode("ascii")]


def segment_spans(payload_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of each payload value: one when it fits, else pieces of segment_bytes."""
    if payload_bytes < 1 or segment_bytes < 1:
        raise EmbeddingFormatError("payload_bytes and segment_bytes must be >= 1")
    return [(off, min(segment_bytes, payload_bytes - off)) for off in range(0, payload_bytes, segment_bytes)]


class Piece(NamedTuple):
    buffer: int  # index in the item's buffer list
    offset: int  # bytes into that buffer
    length: int


def place(spans: list[tuple[int, int]], sizes: list[int]) -> list[list[Piece]]:
    """Where each span of the payload lies in the item's buffers laid end to end (SGLang hands
    an item as page runs: one (address, size) per run). A span in one buffer moves straight
    from / into it; a span across buffers goes through a staging copy."""
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise EmbeddingFormatError(f"buffer sizes must be ints >= 1, got {sizes!r}")
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    out, b = [], 0
    for off, length in spans:
        if off + length > at:
            raise EmbeddingFormatError(f"span ({off}, {length}) runs past the buffers' {at} bytes")
        while starts[b] + sizes[b] <= off:
            b += 1
        pieces, pos, end, i = [], off, off + length, b
        while pos < end:
            take = min(end, starts[i] + sizes[i]) - pos
            pieces.append(Piece(i, pos - starts[i], take))
            pos += take
            i += 1
        out.append(pieces)
    return out


# -- the header --------------------------------------------------------------------------

MAGIC = b"GCEM"
VERSION = 1
# magic, version, header bytes, dtype (NUL-padded), rows, width, payload bytes, segment bytes,
# key digest (the first 8 bytes of sha256 of the item's base key).
_HEADER = struct.Struct("<4sHH16sQQQQ8s")
HEADER_BYTES = _HEADER.size  # 64


def key_digest(base: str) -> bytes:
    return hashlib.sha256(base.encode("ascii")).digest()[:8]


@dataclass(frozen=True)
class Header:
    dtype: str
    rows: int
    width: int
    payload_bytes: int
    segment_bytes: int
    digest: bytes

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            VERSION,
            HEADER_BYTES,
            dtype_tag(self.dtype).encode("ascii"),
            self.rows,
            self.width,
            self.payload_bytes,
            self.segment_bytes,
            self.digest,
        )

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> Header:
        raw = bytes(raw)
        if len(raw) != HEADER_BYTES:
            raise EmbeddingFormatError(f"a header is {HEADER_BYTES} bytes, got {len(raw)}")
        magic, version, size, dtype, rows, width, payload, segment, digest = _HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION or size != HEADER_BYTES:
            raise EmbeddingFormatError(f"not an {FORMAT} header (magic {magic!r}, version {version}, size {size})")
        try:
            name = dtype.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise EmbeddingFormatError(f"bad dtype field {dtype!r}") from None
        return cls(dtype_tag(name), rows, width, payload, segment, digest)

    @classmethod
    def of(
        cls, base: str, dtype: str, rows: int, width: int, element_size: int, segment_bytes: int = SEGMENT_BYTES
    ) -> Header:
        return cls(dtype_tag(dtype), rows, width, rows * width * element_size, segment_bytes, key_digest(base))

    def check(self, expected: Header) -> str | None:
        """None when this header (read) describes what the reader expects; else the mismatch.

        "foreign": the header disagrees with its own key (another dtype, width or item: the
        value is wrong for the key and may be removed); "shape": the item is stored with
        another token count or segment size (a different item under the same SGLang hash, or
        another format's segmentation): a miss, the value left alone."""
        if (self.dtype, self.width, self.digest) != (expected.dtype, expected.width, expected.digest):
            return "foreign"
        if (self.rows, self.payload_bytes, self.segment_bytes) != (
            expected.rows,
            expected.payload_bytes,
            expected.segment_bytes,
        ):
            return "shape"
        return None
