"""Byte-level reversible tokenizer: byte b -> id b; three special ids after the bytes."""

from __future__ import annotations

from collections.abc import Iterable

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
NUM_SPECIAL = 3
SPECIAL_NAMES = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>", PAD_ID: "<|pad|>"}


class ByteTokenizer:
    """decode(encode(s)) == s for every str. Ids >= 259 (unused by encode; an untrained
    model still samples them) decode to byte id % 256 so generated text stays printable."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID

    def __init__(self, vocab_size: int = 4096) -> None:
        if vocab_size < 256 + NUM_SPECIAL:
            raise ValueError(f"vocab_size must be >= {256 + NUM_SPECIAL}, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [BOS_ID] + ids if add_bos else ids

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
            if i < 256:
                out.append(i)
            elif i in SPECIAL_NAMES:
                if not skip_special:
                    out += SPECIAL_NAMES[i].encode()
            else:
                out.append(i % 256)
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def is_special(self, i: int) -> bool:
        return int(i) in SPECIAL_NAMES
