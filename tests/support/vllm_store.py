"""What the vLLM group does to the store behind the engine's back: name a page's value keys, flip
a byte of a stored value in the server's memory, remove a page."""

from __future__ import annotations

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.keys import GroupTag, PageKeys, prompt_page_hashes
from gcache.testing.vllm_models import BLOCK_SIZE
from tests.support.raw_shm import LOOKUP, RawShm

# One layer's page of the tiny models (gcache.testing.vllm_models): 2 kv heads, head size 32, fp32.
PAGE_BYTES = 2 * BLOCK_SIZE * 2 * 32 * 4


def page_keys(model, prompt, value_tags: dict, kind: str = AttentionKind.FULL, pages=None) -> list[list[bytes]]:
    """Per page of the prompt, the keys of its value in the group of `kind` (rank 0 of 1, no
    namespace); value_tags: a run's counters["value_tags"] (what the scheduler learned)."""
    (index, tag, segments), *more = [(int(g), t, n) for g, (k, t, n) in value_tags.items() if k == kind]
    assert not more, f"several {kind} groups: {value_tags}"
    keys = PageKeys(str(model), None, 0, 1, False)
    group = Group(index, kind, (), (), BLOCK_SIZE, 0)
    hashes = prompt_page_hashes(prompt, BLOCK_SIZE)
    chosen = range(len(hashes)) if pages is None else pages
    return [keys.value_keys(hashes[p], group, GroupTag(tag, segments)) for p in chosen]


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
