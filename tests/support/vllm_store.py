"""What the vLLM group does to the store behind the engine's back: name a page's keys, flip
a byte of a stored value in the server's memory, remove a page."""

from __future__ import annotations

from gcache.integrations.vllm.groups import Group
from gcache.integrations.vllm.keys import PageKeys, prompt_page_hashes
from gcache.integrations.vllm.testing import BLOCK_SIZE
from gcache.wire.keys import POOL_FULL, POOL_SWA
from tests.support.raw_shm import LOOKUP, RawShm

# The tiny models' page layout (gcache.integrations.vllm.testing): 2 kv heads, head size 32, fp32.
LAYOUT = f"h2b{BLOCK_SIZE}d32float32"
PAGE_BYTES = 2 * BLOCK_SIZE * 2 * 32 * 4


def group(kind: str, layer_ids) -> Group:
    return Group(0, kind, (), tuple(layer_ids), BLOCK_SIZE, 1 if kind == POOL_SWA else 0, LAYOUT, PAGE_BYTES)


def page_keys(model, prompt, kind: str = POOL_FULL, layer_ids=(0, 1), pages=None) -> list[list[bytes]]:
    """Per page of the prompt, every layer's key (rank 0 of 1, no namespace)."""
    keys = PageKeys(str(model), None, 0, 1, False)
    g = group(kind, layer_ids)
    hashes = prompt_page_hashes(prompt, BLOCK_SIZE)
    chosen = range(len(hashes)) if pages is None else pages
    return [keys.page(hashes[p], g) for p in chosen]


def flip_byte(unix_socket: str, key: bytes, at: int = 100) -> None:
    """Flips one byte of the stored value in the server's arena: its checksum no longer matches."""
    with RawShm(unix_socket) as raw:
        raw.attach()
        frame = raw.request(LOOKUP, {"keys": [key]})
        length = frame.meta["lens"][0]
        assert length > at, f"{key!r} is not stored (length {length})"
        off = frame.meta["offs"][0]
        raw.arena[off + at] ^= 0xFF
        raw.release(leases=[frame.meta["lease"]], no_reply=False)
