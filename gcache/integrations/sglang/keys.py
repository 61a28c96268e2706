"""Store keys for SGLang's pages: which bytes of which rank live under which key.

One value per page *entry*: `get_page_buffer_meta` splits a page into entries
(K and V for MHA; one per layer, too, in `layer_first`), and each entry is
stored under its own key, so reads and writes go straight between the host
pool and the socket. The key (see gcache.wire.keys.KeyBuilder) is

    [namespace "/"] page_hash "." pool "-" layout "-" dtypes "-" part ["@g" layer]
        "_" model [shard] ["_" tp_rank "_" tp_size] ["_" pp_size "_" pp_rank]

- pool: "full" for SGLang's KV pool, else SGLang's pool name ("swa", ...);
- layout: the host pool's byte order (lf, pf, pfd, ph): the same page in two
  layouts is different bytes, so it must never be read back under the other;
- dtypes: the element types of the pool's tensors ("bfloat16"; a Mamba pool's
  "bfloat16.float32", fp8 "float8e4m3fn"): two deployments of one model name whose `--kv-cache-dtype`
  or Mamba state dtypes differ hold equal-sized, different bytes;
- part: "k" / "v" (MHA), "kv" (one entry: MLA), or "page" (the legacy flat page);
- "@g" layer: the layer of a `layer_first` entry;
- model: SGLang's model name with '/' as '-'; shard: "_cp{r}_{n}" under attention
  context parallelism and "_dcp{r}_{n}_page{p}" under decode context parallelism;
- tp suffix: MHA shards differ per TP rank; MLA (rank-replicated) keys omit it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gcache.common.attention import AttentionKind
from gcache.wire.keys import KeyBuilder

LAYOUT_CODES = {"layer_first": "lf", "page_first": "pf", "page_first_direct": "pfd", "page_head": "ph"}
# SGLang names its main KV pool "kv" (PoolName.KV) or "__default__".
_KV_POOL_NAMES = ("kv", "__default__")
PART_PAGE = "page"


class KeyLayoutError(ValueError):
    """A storage config or pool the backend cannot name keys for (the message says why)."""


def pool_tag(pool_name: object) -> str:
    """SGLang's pool name (a PoolName or str) as the key's pool word."""
    name = str(getattr(pool_name, "value", pool_name))
    return AttentionKind.FULL if name in _KV_POOL_NAMES else name


def layout_code(layout: str) -> str:
    code = LAYOUT_CODES.get(layout)
    if code is None:
        raise KeyLayoutError(
            f"host pool layout {layout!r} is not supported by the GCache backend "
            f"(supported: {sorted(LAYOUT_CODES)}); start SGLang with "
            "--hicache-mem-layout page_first (or another of those)"
        )
    return code


def key_builder(storage_config: Any, namespace: str | None) -> KeyBuilder:
    """The KeyBuilder of one rank, from SGLang's HiCacheStorageConfig."""
    if getattr(storage_config, "should_split_heads", False):
        raise KeyLayoutError(
            "heterogeneous TP (extra_config tp_lcm_size with page_head) is not "
            "supported by the GCache backend: drop tp_lcm_size"
        )
    model = "-".join((storage_config.model_name or "default").split("/"))
    cp_size = getattr(storage_config, "attn_cp_size", 1) or 1
    if cp_size > 1:  # each context-parallel rank holds a disjoint slice of every page
        model += f"_cp{storage_config.attn_cp_rank}_{cp_size}"
    dcp_size = getattr(storage_config, "dcp_size", 1) or 1
    if dcp_size > 1:  # MLA shards: equal across DCP groups, different within one
        model += f"_dcp{storage_config.dcp_rank}_{dcp_size}_page{storage_config.logical_page_size}"
    try:
        return KeyBuilder(
            model=model,
            namespace=namespace,
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            is_mla=storage_config.is_mla_model,
        )
    except ValueError as exc:
        raise KeyLayoutError(f"cannot build GCache keys for this rank: {exc}") from None


def entry_parts(entries_per_page: int, split_kv: bool) -> list[tuple[str, int | None]]:
    """(part, layer) of each entry of one page, in get_page_buffer_meta's order.

    MHA pools list K then V, per layer in layer_first: [k0, v0, k1, v1, ...].
    """
    if split_kv:
        if entries_per_page % 2:
            raise KeyLayoutError(f"a K/V pool gave {entries_per_page} buffers per page (expected K/V pairs)")
        layers = entries_per_page // 2
        return [(part, layer if layers > 1 else None) for layer in range(layers) for part in ("k", "v")]
    return [("kv", layer if entries_per_page > 1 else None) for layer in range(entries_per_page)]


class PoolKeys:
    """Keys of one host pool's pages: `entries(page_hashes)` lists every entry key, page by page."""

    def __init__(
        self,
        builder: KeyBuilder,
        pool_name: object,
        layout: str,
        parts: list[tuple[str, int | None]],
        dtypes: str,
    ) -> None:
        if not dtypes or not all(c.isalnum() or c == "." for c in dtypes):
            raise KeyLayoutError(f"pool {pool_name!s}: cannot name its element types {dtypes!r} in a key")
        base = f"{pool_tag(pool_name)}-{layout_code(layout)}-{dtypes}"
        self.builder = builder
        self.parts = [(f"{base}-{part}", layer) for part, layer in parts]
        self.per_page = len(self.parts)

    def entries(self, page_hashes: Iterable[str]) -> list[bytes]:
        key = self.builder.key
        return [key(h, pool, layer) for h in page_hashes for pool, layer in self.parts]


def flat_page_keys(builder: KeyBuilder, pool_name: object, layout: str, dtypes: str) -> PoolKeys:
    """The legacy (v0) interface stores each page as one flat tensor: one key per page."""
    return PoolKeys(builder, pool_name, layout, [(PART_PAGE, None)], dtypes)


def dtypes_word(tensors: Iterable[Any]) -> str:
    """The key's dtypes word: the tensors' element types ("_" dropped: it separates the
    key's fields), sorted, "." between."""
    return ".".join(sorted({str(t.dtype).removeprefix("torch.").replace("_", "") for t in tensors}))
