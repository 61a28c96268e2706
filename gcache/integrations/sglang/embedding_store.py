"""GCache as the store of SGLang's global multimodal embedding cache (sglang 0.5.23).

SGLang's encoder server (`--encoder-only --enable-mm-global-cache`) builds an
EmbeddingCacheController over `EmbeddingStoreFactory.create_backend(--mm-global-cache-backend)`.
The controller registers its host pools (`register_buffer`, one pinned tensor of rows x dim per
modality), asks which items the store holds (`batch_is_exist`), fetches hits into pool pages
(`batch_get_into_multi_buffers`: per item one (address, size) per page run) and stores what its
encoder computed (`batch_put_from_multi_buffers`). This class serves those calls over a
gcache.Client:

- zero copy: the pools are registered with the client, and a payload value moves straight
  between the store and the pool's pages; only a segment that spans two page runs (a fragmented
  pool) goes through a staging copy, bounded per call (gcache_staging_mib);
- one header value per item names the dtype and shape (embedding_values.Header): a header that
  disagrees is a miss, and every value is checksummed (gcache_verify_checksums, on);
- keys: the model identity, SGLang's item hash, the dtype and width, a namespace
  (embedding_values); nothing in them depends on where the weights are mounted;
- no call raises into SGLang: a dead store, a bad checksum, a bad header or a bad argument is a
  miss (False), and the encoder runs (integrations.common.GuardedStore).

Enable it with one registration in every process that builds the encoder (`register()`), or
launch through `python -m gcache.integrations.sglang.serve`, which does it (see serve.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from sglang.srt.mem_cache.embedding_store import EmbeddingStore, EmbeddingStoreFactory

from gcache._native import copy_ranges
from gcache.integrations.common.connect import connect
from gcache.integrations.common.engine_boundary import EngineBoundary
from gcache.integrations.common.extra_config import SettingsError
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.sglang.embedding_settings import CONFIG_ENV, EmbeddingSettings
from gcache.integrations.sglang.embedding_values import (
    HEADER_BYTES,
    SEGMENT_BYTES,
    EmbeddingFormatError,
    EmbeddingKeys,
    Header,
    Piece,
    dtype_tag,
    place,
    segment_spans,
)

log = logging.getLogger("gcache.integrations.sglang.embedding")

BACKEND_NAME = "gcache"
CLI_FLAG = "--mm-global-cache-backend"
REGIONS_MAX = 64  # registered tensors (SGLang registers two: its vision and audio pools)

T = TypeVar("T")
# SGLang's objects (storage config, tensors) are untyped here: Any.


class EmbeddingStats:
    """Thread-safe counters (GuardedStore counts store_errors, calls_while_suspect and
    corrupt_values_removed here too)."""

    COUNTERS = (
        "items_read",
        "items_missed",
        "items_written",
        "items_skipped_existing",
        "items_write_failed",
        "items_refused",
        "exists_calls",
        "bytes_read",
        "bytes_written",
        "bytes_staged",
        "headers_foreign",
        "headers_other_shape",
        "store_errors",
        "calls_while_suspect",
        "corrupt_values_removed",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(self.COUNTERS, 0)

    def count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + k

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)


@dataclass(frozen=True)
class Region:
    """A registered tensor: the addresses it covers and what its rows are."""

    start: int
    end: int
    dtype: str
    width: int
    element_size: int
    tensor: object  # kept alive while registered

    def holds(self, ptr: int, size: int) -> bool:
        return self.start <= ptr and ptr + size <= self.end


@dataclass
class _Item:
    index: int  # in the call's lists
    keys: list[bytes]  # header key, then the payload's segment keys
    header: Header  # what this item's header must say
    ptrs: list[int]
    spans: list[tuple[int, int]]  # (offset, length) per payload value
    pieces: list[list[Piece]]  # per payload value, where it lies in ptrs

    def staged_bytes(self) -> int:
        return sum(length for (_, length), pieces in zip(self.spans, self.pieces) if len(pieces) > 1)


# A staging copy: the buffer, and the pieces of the item's page runs it stands for.
_Staged = tuple[npt.NDArray[np.uint8], list[Piece]]
# A put's staging copy: the item, the buffer, and the pieces it is gathered from.
_Gather = tuple[_Item, npt.NDArray[np.uint8], list[Piece]]


class _Refused(Exception):
    """An item this store cannot serve (the message says why): a False for it alone."""


def _served_model_name() -> str | None:
    """SGLang's served model name in this process, when its server args are published."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        return getattr(args, "served_model_name", None) or getattr(args, "model_path", None)
    except Exception:  # not inside a launched SGLang: nothing published
        return None


def _u64(values: list[int]) -> npt.NDArray[np.uint64]:
    return np.asarray(values, dtype=np.uint64)


class GCacheEmbeddingStore(EmbeddingStore):
    """SGLang's EmbeddingStore over GCache (see the module doc)."""

    def __init__(self, storage_config: dict[str, Any] | str | None = None, **_ignored: Any) -> None:
        self.settings = EmbeddingSettings.from_config(storage_config)
        model = self.settings.model or _served_model_name()
        if not model:
            raise SettingsError(
                f"the GCache embedding store needs a model identity: set gcache_model in {CONFIG_ENV} "
                "(a name that stays the same wherever the weights are mounted)"
            )
        if not self.settings.model:
            log.warning(
                "GCache embedding store: no gcache_model, keys use SGLang's served model name %r; "
                "set gcache_model so encoders that mount the weights elsewhere share items",
                model,
            )
        self.keys = EmbeddingKeys(model, self.settings.namespace)
        self.stats = EmbeddingStats()
        self._safely = EngineBoundary("GCache embedding store", log)  # every engine hook: never raises into it
        self.client = connect(self.settings, "GCache embedding store")
        self.store = GuardedStore(self.client, self.settings.suspect_s, self.stats, log, remove_corrupt=True)
        self.staging_bytes = self.settings.staging_mib << 20
        self._regions: list[Region] = []
        self._lock = threading.Lock()
        log.info(
            "GCache embedding store: store %s, model %s, namespace %s",
            self.settings.url,
            self.keys.model,
            self.settings.namespace,
        )

    # -- the boundary: nothing raises into SGLang ---------------------------------------

    # -- registration ---------------------------------------------------------------------

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """SGLang's pool tensor (rows x dim, the model's dtype): its addresses become usable,
        and its dtype and width name the items read into or written from it."""
        self._safely("register_buffer", None, self._register, tensor)

    def _register(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.dim() < 2 or not tensor.is_contiguous() or tensor.numel() == 0:
            log.warning(
                "GCache embedding store: not registering a %s tensor of shape %s on %s "
                "(a contiguous host tensor of rows x width is needed); items in it are misses",
                tensor.dtype,
                tuple(tensor.shape),
                tensor.device,
            )
            return
        start = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        region = Region(
            start, start + nbytes, dtype_tag(str(tensor.dtype)), int(tensor.shape[-1]), tensor.element_size(), tensor
        )
        with self._lock:
            if any(r.start == start and r.end == region.end for r in self._regions):
                return
            if len(self._regions) >= REGIONS_MAX:
                log.warning("GCache embedding store: %d buffers registered already; not one more", REGIONS_MAX)
                return
            self.client.register_buffer(start, nbytes)
            self._regions.append(region)

    def layouts(self) -> list[tuple[str, int]]:
        """(dtype, width) of the registered pools, each once."""
        with self._lock:
            return sorted({(r.dtype, r.width) for r in self._regions})

    def _region_of(self, ptr: int, size: int) -> Region:
        if not isinstance(ptr, int) or not isinstance(size, int) or size < 1:
            raise _Refused(f"bad buffer ({ptr!r}, {size!r})")
        with self._lock:
            for region in self._regions:
                if region.holds(ptr, size):
                    return region
        raise _Refused(f"buffer {ptr:#x}+{size} is in no registered tensor (register_buffer)")

    # -- keys ---------------------------------------------------------------------------

    def item_keys(self, mm_hash: object, dtype: str, width: int, payload_bytes: int) -> list[bytes]:
        """The keys of one item: its header, then its payload's segments."""
        base = self.keys.base(mm_hash, dtype, width)
        return [self.keys.header_key(base), *self.keys.data_keys(base, len(segment_spans(payload_bytes)))]

    def get_key(self, mm_hash: str) -> str:
        """The item's header key in the first registered pool's dtype and width (before any
        pool is registered: the key's beginning, which names the item's content)."""
        layouts = self.layouts()
        if not layouts:
            return self.keys.item_prefix(mm_hash)
        return self.keys.header_key(self.keys.base(mm_hash, *layouts[0])).decode()

    def _item(self, index: int, mm_hash: str, ptrs: Sequence[int], sizes: Sequence[int]) -> _Item:
        if not isinstance(ptrs, (list, tuple)) or not isinstance(sizes, (list, tuple)) or not ptrs:
            raise _Refused("an item needs a list of buffers and a list of sizes")
        if len(ptrs) != len(sizes):
            raise _Refused(f"{len(ptrs)} buffers but {len(sizes)} sizes")
        regions = [self._region_of(p, s) for p, s in zip(ptrs, sizes)]
        first = regions[0]
        if any((r.dtype, r.width) != (first.dtype, first.width) for r in regions):
            raise _Refused("an item's buffers lie in tensors of different dtypes or widths")
        total = sum(sizes)
        row = first.width * first.element_size
        if total % row:
            raise _Refused(f"{total} bytes is not a whole number of {first.width}-wide {first.dtype} rows")
        try:
            base = self.keys.base(mm_hash, first.dtype, first.width)
        except EmbeddingFormatError as exc:
            raise _Refused(str(exc)) from None
        spans = segment_spans(total, SEGMENT_BYTES)
        header = Header.of(base, first.dtype, total // row, first.width, first.element_size)
        keys = [self.keys.header_key(base), *self.keys.data_keys(base, len(spans))]
        return _Item(index, keys, header, list(ptrs), spans, place(spans, list(sizes)))

    def _items(self, what: str, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[_Item]:
        if len(ptrs) != len(hashes) or len(sizes) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes, {len(ptrs)} buffer lists, {len(sizes)} size lists")
        items, refused = [], []
        for i, (h, p, s) in enumerate(zip(hashes, ptrs, sizes)):
            try:
                items.append(self._item(i, h, p, s))
            except _Refused as exc:
                refused.append(f"{h}: {exc}")
        if refused:
            self.stats.count("items_refused", len(refused))
            log.warning("GCache embedding store %s: %d item(s) refused: %s", what, len(refused), "; ".join(refused[:3]))
        return items

    # -- reads ----------------------------------------------------------------------------

    def batch_get_into_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Reads each item into its page runs (per item a list of addresses and sizes)."""
        return self._safely("get", [False] * len(hashes), self._get, hashes, ptrs, sizes)

    def batch_get(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Reads each item into one buffer (an address and its size)."""
        return self.batch_get_into_multi_buffers(hashes, [[p] for p in ptrs], [[s] for s in sizes])

    def _get(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[bool]:
        out = [False] * len(hashes)
        keys: list[bytes] = []
        bufs: list[bytearray | int | npt.NDArray[np.uint8]] = []  # a header, a pool address, a staging copy
        lens: list[int] = []
        plans: list[tuple[_Item, int, bytearray, list[_Staged]]] = []  # item, its first key's index, header, staged
        budget = self.staging_bytes
        for item in self._items("get", hashes, ptrs, sizes):
            need = item.staged_bytes()
            if need > budget:
                self.stats.count("items_refused")
                log.warning("GCache embedding store get: staging bound (gcache_staging_mib) reached; a miss")
                continue
            budget -= need
            header = bytearray(HEADER_BYTES)
            staged: list[_Staged] = []
            plans.append((item, len(keys), header, staged))
            keys.append(item.keys[0])
            bufs.append(header)
            lens.append(HEADER_BYTES)
            for key, (_, length), pieces in zip(item.keys[1:], item.spans, item.pieces):
                keys.append(key)
                lens.append(length)
                if len(pieces) == 1:
                    bufs.append(item.ptrs[pieces[0].buffer] + pieces[0].offset)
                else:
                    stage = np.empty(length, dtype=np.uint8)
                    bufs.append(stage)
                    staged.append((stage, pieces))
        got = self.store.get_into(keys, bufs, lens)
        foreign, foreign_items, other_shape = [], 0, 0
        for item, start, header, staged in plans:
            values = got[start : start + len(item.keys)]
            if values[0] != HEADER_BYTES:
                continue  # no header (never stored, evicted, a bad checksum): a miss
            try:
                problem = Header.unpack(header).check(item.header)
            except EmbeddingFormatError:
                problem = "foreign"
            if not problem and any(g != n for g, n in zip(values[1:], lens[start + 1 : start + len(item.keys)])):
                continue  # a payload value missing, unreadable or of another size: a miss
            if problem == "foreign":
                foreign.extend(item.keys)
                foreign_items += 1
            elif problem == "shape":
                other_shape += 1
            if problem:
                continue
            if staged:
                self._scatter(item, staged)
            out[item.index] = True
        if foreign_items or other_shape:
            log.warning(
                "GCache embedding store get: %d header(s) disagree with their key (removed), "
                "%d item(s) stored with another shape: misses",
                foreign_items,
                other_shape,
            )
            self.stats.count("headers_foreign", foreign_items)
            self.stats.count("headers_other_shape", other_shape)
            if foreign:
                self.store.remove(foreign)
        self.stats.count("items_read", sum(out))
        self.stats.count("items_missed", len(hashes) - sum(out))
        self.stats.count("bytes_read", sum(item.header.payload_bytes for item, *_ in plans if out[item.index]))
        return out

    def _scatter(self, item: _Item, staged: list[_Staged]) -> None:
        dst: list[int] = []
        src: list[int] = []
        n: list[int] = []
        for stage, pieces in staged:
            base, at = stage.ctypes.data, 0
            for piece in pieces:
                dst.append(item.ptrs[piece.buffer] + piece.offset)
                src.append(base + at)
                n.append(piece.length)
                at += piece.length
            self.stats.count("bytes_staged", at)
        copy_ranges(_u64(dst), _u64(src), _u64(n))

    # -- writes ---------------------------------------------------------------------------

    def batch_put_from_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Stores each item from its page runs; True when the store holds it (now or already)."""
        return self._safely("put", [False] * len(hashes), self._put, hashes, ptrs, sizes)

    def batch_put(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return self.batch_put_from_multi_buffers(hashes, [[p] for p in ptrs], [[s] for s in sizes])

    def _put(self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[bool]:
        out = [False] * len(hashes)
        items = self._items("put", hashes, ptrs, sizes)
        if self.settings.skip_existing and items:
            # Like SGLang's Mooncake store, probe first: an item another encoder stored costs
            # its keys in one EXISTS instead of its bytes on the wire.
            flags = self.store.exists_flags([k for item in items for k in item.keys])
            self.stats.count("exists_calls")
            todo, at = [], 0
            for item in items:
                if all(flags[at : at + len(item.keys)]):
                    out[item.index] = True
                else:
                    todo.append(item)
                at += len(item.keys)
            self.stats.count("items_skipped_existing", len(items) - len(todo))
            items = todo
        keys: list[bytes] = []
        bufs: list[bytes | int | npt.NDArray[np.uint8]] = []  # a pool address, a staging copy, a header
        lens: list[int] = []
        gathers: list[_Gather] = []
        spans: list[tuple[_Item, int]] = []  # item, its first payload key's index
        budget = self.staging_bytes
        for item in items:
            need = item.staged_bytes()
            if need > budget:
                self.stats.count("items_refused")
                log.warning("GCache embedding store put: staging bound (gcache_staging_mib) reached; not stored")
                continue
            budget -= need
            spans.append((item, len(keys)))
            for key, (_, length), pieces in zip(item.keys[1:], item.spans, item.pieces):
                keys.append(key)
                lens.append(length)
                if len(pieces) == 1:
                    bufs.append(item.ptrs[pieces[0].buffer] + pieces[0].offset)
                else:
                    stage = np.empty(length, dtype=np.uint8)
                    bufs.append(stage)
                    gathers.append((item, stage, pieces))
        # Headers after every payload: a reader that finds a header finds its payload stored.
        header_at = len(keys)
        for item, _ in spans:
            keys.append(item.keys[0])
            bufs.append(item.header.pack())
            lens.append(HEADER_BYTES)
        if gathers:
            self._gather(gathers)
        done = self.store.put_from(keys, bufs, lens) if keys else []
        orphans = []
        for j, (item, start) in enumerate(spans):
            payload_ok = all(done[start : start + len(item.keys) - 1])
            header_ok = done[header_at + j]
            if payload_ok and header_ok:
                out[item.index] = True
            elif header_ok:
                orphans.append(item.keys[0])  # a header without its payload would read as a hit
        if orphans:
            self.store.remove(orphans)
        written = [item for item, _ in spans if out[item.index]]
        self.stats.count("items_written", len(written))
        self.stats.count("bytes_written", sum(item.header.payload_bytes for item in written))
        self.stats.count("items_write_failed", len(hashes) - sum(out))
        return out

    def _gather(self, gathers: list[_Gather]) -> None:
        dst: list[int] = []
        src: list[int] = []
        n: list[int] = []
        for item, stage, pieces in gathers:
            base, at = stage.ctypes.data, 0
            for piece in pieces:
                dst.append(base + at)
                src.append(item.ptrs[piece.buffer] + piece.offset)
                n.append(piece.length)
                at += piece.length
            self.stats.count("bytes_staged", at)
        copy_ranges(_u64(dst), _u64(src), _u64(n))

    # -- existence ------------------------------------------------------------------------

    def batch_is_exist(self, hashes: list[str]) -> list[bool]:
        """Per item: its header and first payload value are stored, in the dtype and width of a
        registered pool (the controller asks without saying which modality)."""
        return self._safely("exists", [False] * len(hashes), self._exists, hashes)

    def _exists(self, hashes: list[str]) -> list[bool]:
        layouts = self.layouts()
        if not hashes or not layouts:
            return [False] * len(hashes)
        keys: list[bytes] = []
        for h in hashes:
            for dtype, width in layouts:
                keys.extend(self.keys.probe_keys(self.keys.base(h, dtype, width)))
        self.stats.count("exists_calls")
        flags = self.store.exists_flags(keys)
        per = 2 * len(layouts)
        return [
            any(all(flags[i * per + 2 * j : i * per + 2 * j + 2]) for j in range(len(layouts)))
            for i in range(len(hashes))
        ]

    # -- lifecycle --------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return self.stats.snapshot()

    def close(self) -> None:
        self.client.close()


# -- registration with SGLang ------------------------------------------------------------

_CLI_NAMES: set[str] = set()


def register(name: str = BACKEND_NAME, *, cli: bool = True) -> None:
    """Makes `name` an SGLang embedding-store backend: EmbeddingStoreFactory.register_backend
    (what `create_backend(--mm-global-cache-backend)` looks up), and, with `cli`, a choice of
    SGLang's `--mm-global-cache-backend` flag, whose argparse choices are otherwise ["mooncake"].

    Registration lives in the process: run it in every process that builds an encoder
    (serve.py does, for SGLang's spawned TP ranks too)."""
    EmbeddingStoreFactory.register_backend(name, __name__, GCacheEmbeddingStore.__name__)
    if cli:
        allow_cli_choice(name)


def allow_cli_choice(name: str) -> None:
    """Adds `name` to the choices of SGLang's --mm-global-cache-backend in every parser that
    ServerArgs.add_cli_args builds from now on (the field's choices are fixed in its
    annotation, re-read at each build)."""
    from sglang.srt.server_args import ServerArgs

    _CLI_NAMES.add(name)
    if getattr(ServerArgs.add_cli_args, "_gcache_choices", False):
        return
    original = ServerArgs.add_cli_args

    def add_cli_args(parser: Any) -> Any:
        result = original(parser)
        for action in parser._actions:
            if CLI_FLAG in action.option_strings and action.choices is not None:
                action.choices = [*action.choices, *sorted(_CLI_NAMES - set(action.choices))]
        return result

    add_cli_args.__dict__["_gcache_choices"] = True  # a function attribute; mypy models none on a def
    ServerArgs.add_cli_args = staticmethod(add_cli_args)


__all__ = ["GCacheEmbeddingStore", "Piece", "register", "allow_cli_choice"]
