"""Store keys of vLLM's pages: one value per (page, KV cache group, TP rank) holding all of the
group's layers for one vLLM block (values.GroupValues), in segments when it is larger than the
node's value limit.

    [namespace "/"] page_hash "." pool "-" tag "@g" group "_" model "_" tp_rank "_" tp_size ["@s" i]

- page_hash: the content-addressed chain of gcache.wire.keys (SGLang's HiCache chain) over
  the prompt's token ids, one hash per vLLM block; a request's cache_salt seeds the chain;
- pool: "full" or "swa" (the KV cache group's kind); group: its index in vLLM's config;
- tag: everything that changes the value's bytes (`value_tag`): the page's byte order (heads or
  tokens outer), the kernel block size, heads, bytes per head and token, dtype, the number of
  layers and a digest of their ids and runs, and the segment count. The worker learns it from
  the KV views vLLM gives it and hands it to the scheduler (vLLM's connector handshake), so
  engines with other layouts or versions never read each other's values;
- model: kv_connector_extra_config["gcache_model"], else vLLM's served model name, with
  characters outside [A-Za-z0-9._-] as '-';
- tp suffix: each TP rank holds its own heads; MLA (rank-replicated) keys omit it;
- "@s" i: the segments of a value over the segment limit (none when it fits).
Two vLLM instances of one model and layout share pages; other models, layouts or ranks never do.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from gcache.wire.keys import KeyBuilder, page_hashes_array

if TYPE_CHECKING:
    from gcache.integrations.vllm.kv.groups import Group

_BAD = re.compile(r"[^A-Za-z0-9._-]+")
MODEL_NAME_MAX = 96  # longer names are shortened to a prefix plus a hash


def model_tag(name: str) -> str:
    tag = _BAD.sub("-", name).strip("-") or "model"
    if len(tag) > MODEL_NAME_MAX:
        tag = tag[: MODEL_NAME_MAX - 17] + "-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return tag


def salt_hash(cache_salt: str | None) -> str | None:
    """The chain's seed for a request's cache_salt (None: no seed, the shared chain)."""
    return hashlib.sha256(cache_salt.encode()).hexdigest() if cache_salt else None


class MMItem(NamedTuple):
    """A multimodal item of a prompt: vLLM's content hash of it and the placeholder tokens it fills."""

    identifier: str  # vLLM's mm_hash (MultiModalFeatureSpec.identifier)
    offset: int  # its first placeholder token in the prompt
    length: int  # its placeholder tokens


def _mm_extra(items: Sequence[MMItem], start: int, end: int) -> bytes:
    """What a page [start, end) holds of multimodal items: each overlapping item's identifier and
    where it begins relative to the page (negative: it began on an earlier page)."""
    return "|".join(
        f"{i.identifier}@{i.offset - start}" for i in items if i.offset < end and i.offset + i.length > start
    ).encode()


def prompt_page_hashes(
    token_ids: Iterable[int], block_size: int, cache_salt: str | None = None, mm_items: Sequence[MMItem] = ()
) -> list[str]:
    """One chained hash per full page. The placeholder tokens of an image are the same for every
    image, so a page that holds (part of) a multimodal item hashes that item's content hash and
    position too: other images give other pages, the same image in the same place the same page.
    Pages before the first item keep the text chain (the shared one of gcache.wire.keys)."""
    if not mm_items:
        return page_hashes_array(list(token_ids), block_size, salt_hash(cache_salt))
    raw = np.asarray(list(token_ids), dtype=np.int64).astype("<u4").tobytes()
    seed = salt_hash(cache_salt)
    prior = bytes.fromhex(seed) if seed else b""
    out = []
    for k in range(len(raw) // (4 * block_size)):
        h = hashlib.sha256(prior)
        h.update(raw[4 * k * block_size : 4 * (k + 1) * block_size])
        extra = _mm_extra(mm_items, k * block_size, (k + 1) * block_size)
        if extra:
            h.update(b"\0mm\0" + extra)
        prior = h.digest()
        out.append(prior.hex())
    return out


class GroupTag(NamedTuple):
    """How one group's values are named: the worker computes it, the scheduler receives it."""

    tag: str  # key-safe
    segments: int  # pieces of one value (1: the value is one store value)


def value_tag(
    order: str, kernel_block: int, heads: int, content_bytes: int, dtype: str, layers: list[Any], segments: int
) -> str:
    """The key's tag of a group's values. `layers`: per stored layer (id, its runs as (offset,
    length) pairs): a different layer set or page split is a different digest."""
    digest = hashlib.sha256(repr(layers).encode()).hexdigest()[:8]
    return f"{order}k{kernel_block}h{heads}c{content_bytes}{_BAD.sub('', dtype)}n{len(layers)}-{digest}s{segments}"


class PageKeys:
    """Keys of one rank's values: value_keys(hash, group, tag) -> the keys of its segments."""

    def __init__(self, model: str, namespace: str | None, tp_rank: int, tp_size: int, is_mla: bool):
        self.builder = KeyBuilder(
            model=model_tag(model), namespace=namespace, tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla
        )

    def value_keys(self, page_hash: str, group: Group, tag: GroupTag) -> list[bytes]:
        return segment_keys(self.builder.key(page_hash, f"{group.kind}-{tag.tag}", group.index), tag.segments)


def rank_keys(model: str, namespace: str | None, tp_size: int, is_mla: bool) -> list[PageKeys]:
    """The keys of every TP rank (the scheduler asks for all of them: a hit needs each rank's heads)."""
    ranks = 1 if is_mla else tp_size
    return [PageKeys(model, namespace, r, tp_size, is_mla) for r in range(ranks)]


def segment_keys(value_key: bytes, segments: int) -> list[bytes]:
    """The keys of a value stored in `segments` pieces: the key itself when one, else `@s{i}`
    appended (a value over the node's value limit; values.GroupValues.segment_spans)."""
    if segments == 1:
        return [value_key]
    return [value_key + b"@s%d" % i for i in range(segments)]


def mla_writer(page_hash: str, tp_size: int) -> int:
    """The one TP rank that writes an MLA page (every rank holds the same bytes; all read)."""
    return int(page_hash[:8], 16) % tp_size
