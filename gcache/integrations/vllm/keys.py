"""Store keys of vLLM's pages: one value per (page, layer).

    [namespace "/"] page_hash "." pool "-" layout "@g" layer "_" model "_" tp_rank "_" tp_size

- page_hash: the content-addressed chain of gcache.wire.keys (SGLang's HiCache chain) over
  the prompt's token ids, one hash per vLLM block; a request's cache_salt seeds the chain;
- pool: "full" or "swa" (the KV cache group's kind);
- layout: kv heads, block size, head size and dtype ("h2b32d32float32"): the same tokens in
  another layout are other bytes and must never be read back under it;
- layer: the model's layer number;
- model: kv_connector_extra_config["gcache_model"], else vLLM's served model name, with
  characters outside [A-Za-z0-9._-] as '-';
- tp suffix: each TP rank holds its own heads; MLA (rank-replicated) keys omit it.
Two vLLM instances of one model and layout share pages; other models, layouts or ranks never do.
"""

from __future__ import annotations

import hashlib
import re

from gcache.wire.keys import KeyBuilder, page_hashes_array

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


def prompt_page_hashes(token_ids, block_size: int, cache_salt: str | None = None) -> list[str]:
    return page_hashes_array(list(token_ids), block_size, salt_hash(cache_salt))


class PageKeys:
    """Keys of one rank's pages: key(hash, group, layer_id)."""

    def __init__(self, model: str, namespace: str | None, tp_rank: int, tp_size: int, is_mla: bool):
        self.builder = KeyBuilder(
            model=model_tag(model), namespace=namespace, tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla
        )

    def key(self, page_hash: str, group, layer_id: int) -> bytes:
        return self.builder.key(page_hash, f"{group.kind}-{group.layout}", layer_id)

    def page(self, page_hash: str, group) -> list[bytes]:
        """Every layer's key of one page of one group, in the group's layer order."""
        return [self.key(page_hash, group, layer) for layer in group.layer_ids]


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
