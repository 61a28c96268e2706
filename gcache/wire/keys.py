"""Content-addressed page keys, compatible with SGLang HiCache.

A page's hash chains onto the previous page's: sha256(prior page digest bytes
|| the page's token ids as 4-byte little-endian unsigned), as hex. This is
byte for byte SGLang's `get_hash_str` (python/sglang/srt/mem_cache/
hicache_storage.py), so both name the same prefix the same way. Because each
hash folds in its parent, a key names a whole prefix, which is what makes
`batch_exists_prefix` answer "how long a prefix is cached".

`KeyBuilder` turns a page hash into a store key: an optional namespace
(tenant) prefix, then the hash, the pool (`full`, `swa`, ...), an optional
layer group, and the model / rank suffix SGLang's backends use.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gcache.common.attention import AttentionKind
from gcache.errors import InvalidArgumentError, KeyInvalidError
from gcache.wire.protocol import KEY_BYTES_MAX

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

TOKEN_ID_MAX = 2**32 - 1
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _token_bytes(token_ids: Iterable[int | tuple[int, ...]]) -> bytes:
    # Tuples (EAGLE bigram mode in SGLang) contribute each element, in order.
    flat: list[int] = []
    for t in token_ids:
        if isinstance(t, tuple):
            flat.extend(t)
        else:
            flat.append(t)
    try:
        return struct.pack(f"<{len(flat)}I", *flat)
    except struct.error:
        bad = next((t for t in flat if not isinstance(t, int) or not 0 <= t <= TOKEN_ID_MAX), None)
        raise InvalidArgumentError(f"token ids must be ints in [0, 2^32), got {bad!r}") from None


def get_hash_str(token_ids: Sequence[int], prior_hash: str | None = None) -> str:
    """SGLang's page hash: sha256(bytes.fromhex(prior_hash) || tokens as u32 LE), hex."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    hasher.update(_token_bytes(token_ids))
    return hasher.hexdigest()


def page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """Chained hashes of every full page of `token_ids`; a partial last page gets none.

    `prior_hash` is the hash of the page before token_ids[0] (None at the start
    of a sequence), so a sequence can be hashed in pieces.
    """
    if not isinstance(page_size, int) or page_size <= 0:
        raise InvalidArgumentError(f"page_size must be an int > 0, got {page_size!r}")
    hashes = []
    prior = prior_hash
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prior = get_hash_str(token_ids[start : start + page_size], prior)
        hashes.append(prior)
    return hashes


def page_hashes_array(tokens: ArrayLike, page_size: int, prior_hash: str | None = None) -> list[str]:
    """page_hashes for a 1-D integer array (numpy): the same chain, hashed from one
    u32 buffer instead of packing token by token (the worker hashes every prompt)."""
    import numpy as np

    if not isinstance(page_size, int) or page_size <= 0:
        raise InvalidArgumentError(f"page_size must be an int > 0, got {page_size!r}")
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError("tokens must be a 1-D array of ints")
    n = arr.size // page_size
    if n and (int(arr[: n * page_size].min()) < 0 or int(arr[: n * page_size].max()) > TOKEN_ID_MAX):
        raise InvalidArgumentError("token ids must be ints in [0, 2^32)")
    raw = arr[: n * page_size].astype("<u4").tobytes()
    step = 4 * page_size
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    out = []
    sha256 = hashlib.sha256
    for k in range(n):
        h = sha256(prior)
        h.update(raw[k * step : (k + 1) * step])
        prior = h.digest()
        out.append(prior.hex())
    return out


def _check_name(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise InvalidArgumentError(f"{what} {value!r} may only use letters, digits, '.', '_' and '-'")
    return value


@dataclass(frozen=True)
class KeyBuilder:
    """Builds store keys for one model deployment (and one tenant, if namespaced).

    Key layout (ASCII):  [namespace "/"] page_hash "." pool ["@g" layer_group]
                         "_" model "_" tp_rank "_" tp_size ["_" pp_size "_" pp_rank]
    The model name has '/' replaced by '-', as SGLang's HiCacheFile does. MLA
    models share KV across TP ranks, so `is_mla` drops the TP suffix.
    """

    model: str
    namespace: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla: bool = False

    def __post_init__(self) -> None:
        if self.namespace is not None:
            _check_name(self.namespace, "namespace")
        _check_name(self.model.replace("/", "-"), "model")
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_rank < self.pp_size:
            raise InvalidArgumentError(
                f"ranks must satisfy 0 <= rank < size (tp {self.tp_rank}/{self.tp_size}, "
                f"pp {self.pp_rank}/{self.pp_size})"
            )

    @property
    def suffix(self) -> str:
        suffix = "_" + self.model.replace("/", "-")
        if not self.is_mla:
            suffix += f"_{self.tp_rank}_{self.tp_size}"
        if self.pp_size > 1:
            suffix += f"_{self.pp_size}_{self.pp_rank}"
        return suffix

    def key(self, page_hash: str, pool: str = AttentionKind.FULL, layer_group: int | None = None) -> bytes:
        """The store key of one page of one pool (and layer group)."""
        _check_name(pool, "pool")
        if not page_hash or not _NAME.match(page_hash):
            raise KeyInvalidError(f"page hash {page_hash!r} must be a non-empty hex string")
        parts = [self.namespace + "/" if self.namespace else "", page_hash, ".", pool]
        if layer_group is not None:
            if not isinstance(layer_group, int) or layer_group < 0:
                raise InvalidArgumentError(f"layer_group must be an int >= 0, got {layer_group!r}")
            parts.append(f"@g{layer_group}")
        parts.append(self.suffix)
        raw = "".join(parts).encode("ascii")
        if len(raw) > KEY_BYTES_MAX:
            raise KeyInvalidError(
                f"key of {len(raw)} bytes exceeds {KEY_BYTES_MAX}: shorten the namespace or model name"
            )
        return raw

    def keys(
        self, page_hashes_: Sequence[str], pool: str = AttentionKind.FULL, layer_group: int | None = None
    ) -> list[bytes]:
        return [self.key(h, pool, layer_group) for h in page_hashes_]
