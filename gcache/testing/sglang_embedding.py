"""SGLang's embedding-cache controller and item hash on a CPU-only machine, for the tests and the
bench (not used by the store itself).

- `load_controller_module()`: sglang/srt/mem_cache/embedding_cache_controller.py imports
  `Modality` from sglang.srt.managers.schedule_batch, whose imports reach transformers and
  SGLang's serving stack (absent from the `--no-deps` test venv). While the controller module
  is imported, that one name is served by a module holding SGLang's real `Modality`
  (sglang/srt/multimodal/modality.py); the stand-in is removed again right after.
- `CpuController`: SGLang's EmbeddingCacheController, unchanged but for its pools, which it
  asks SGLang's own `_create_pools` for unpinned (pinned host memory needs an accelerator).
  Built under `get_parallel().override(tp_size=1, tp_rank=0, ...)`: the process-group context
  SGLang's launcher publishes.
- `stage_into_pool(controller, ...)`: what the encoder server's `store_to_pool_async` +
  `wait_store_to_pool` do after a ViT forward (pages allocated with eviction, the entry
  FILLING, rows copied into its page runs by SGLang's `_copy_embedding_page_runs`, then
  READY), without the CUDA stream and event those two need.
- `sglang_item_hash(tensor)`: SGLang's `hash_feature` (the item hash the encoder server keys
  by), compiled unchanged from the installed sglang/srt/managers/mm_utils.py.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

from gcache.testing.sglang_modules import SGLANG_VERSION, load_sglang_storage, sglang_root

# SGLang's objects (the controller, its pools and entries, Modality, tensors, dtypes) are
# untyped here: Any.

_SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
_CONTROLLER = "sglang.srt.mem_cache.embedding_cache_controller"


def load_controller_module() -> types.ModuleType:
    """sglang's embedding_cache_controller module (see the module doc)."""
    load_sglang_storage()
    if _CONTROLLER in sys.modules:
        return sys.modules[_CONTROLLER]
    from sglang.srt.multimodal.modality import Modality

    stand_in = None
    if _SCHEDULE_BATCH not in sys.modules:
        stand_in = types.ModuleType(_SCHEDULE_BATCH)
        stand_in.__dict__["Modality"] = Modality  # mypy knows no attributes of a new module
        sys.modules[_SCHEDULE_BATCH] = stand_in
    try:
        import sglang.srt.mem_cache.embedding_cache_controller as controller
    finally:
        if stand_in is not None and sys.modules.get(_SCHEDULE_BATCH) is stand_in:
            del sys.modules[_SCHEDULE_BATCH]
    return cast(types.ModuleType, controller)  # sglang ships no types: Any to mypy


_CPU_CLASS: type[Any] | None = None


def controller_class() -> type[Any]:
    """CpuController: SGLang's EmbeddingCacheController with unpinned pools."""
    global _CPU_CLASS
    if _CPU_CLASS is None:
        base: Any = load_controller_module().EmbeddingCacheController

        class CpuController(base):
            def _create_pools(self, pin_memory: bool) -> Any:
                return super()._create_pools(pin_memory=False)

            def stop(self, timeout_s: float = 10.0) -> bool:
                self.stop_event.set()
                self.io_thread.join(timeout_s)
                return not self.io_thread.is_alive()

        _CPU_CLASS = CpuController
    return _CPU_CLASS


def make_controller(store: Any, *, image_dim: int, dtype: Any, pool_mib: float, audio_dim: int | None = None) -> Any:
    """A CpuController over `store`: SGLang's pools (80% vision, 20% audio) of pool_mib MiB."""
    from sglang.srt.multimodal.modality import Modality
    from sglang.srt.runtime_context import get_parallel

    dims = {Modality.IMAGE: image_dim}
    if audio_dim is not None:
        dims[Modality.AUDIO] = audio_dim
    with get_parallel().override(tp_size=1, tp_rank=0, tp_group=SimpleNamespace(cpu_group=None)):
        return controller_class()(
            embedding_store=store, max_pool_size_gb=pool_mib / 1024, hidden_dims=dims, dtype=dtype
        )


def stage_into_pool(controller: Any, mm_hashes: list[str], tensors: list[Any], modality: Any) -> list[str]:
    """The encoder server's store_to_pool_async + wait_store_to_pool, on the CPU (see the
    module doc); the hashes staged (an item that cannot be is skipped, as SGLang skips it)."""
    module = load_controller_module()
    pool = controller._get_pool(modality)
    staged: list[str] = []
    for mm_hash, tensor in zip(mm_hashes, tensors):
        src = tensor.detach().reshape(-1, tensor.shape[-1]).contiguous()
        with controller.lock:
            if src.shape[1] != pool.dim or mm_hash in controller.entries:
                continue
            runs = controller._allocate_with_eviction(pool, int(src.shape[0]))
            if runs is None:
                continue
            entry = module.EmbeddingCacheEntry(
                hash=mm_hash,
                modality=modality,
                num_tokens=int(src.shape[0]),
                dim=int(src.shape[1]),
                page_runs=runs,
                state=module.EntryState.FILLING,
            )
            controller.entries[mm_hash] = entry
        controller._copy_embedding_page_runs(src=src, dst=pool.tensor, entry=entry, pool=pool, src_is_pool=False)
        with controller.lock:
            controller._mark_ready(entry)
        staged.append(mm_hash)
    return staged


def pool_embedding(controller: Any, mm_hash: str) -> Any:
    """The item's rows as the encoder server's CPU assembly reads them (get_pool_views, one
    torch.cat, release_pool_views); None when the entry is not READY."""
    import torch

    views = controller.get_pool_views([mm_hash])[0]
    try:
        return None if views is None else torch.cat(views).clone()
    finally:
        if views is not None:
            controller.release_pool_views([mm_hash])


@contextlib.contextmanager
def running(controller: Any) -> Iterator[Any]:
    try:
        yield controller
    finally:
        controller.stop()


_HASH: Callable[[Any], Any] | None = None


def sglang_item_hash(feature: Any) -> str:
    """str(hash_feature(feature)): SGLang's item hash of a preprocessed CPU tensor, as the
    encoder server hands it to the embedding store."""
    global _HASH
    if _HASH is None:
        import hashlib

        import numpy as np
        import torch

        sglang = sglang_root()
        if sglang is None:
            raise ImportError(f"sglang is not installed (pip install --no-deps sglang=={SGLANG_VERSION})")
        root = sglang / "srt"
        wanted = {
            root / "managers" / "mm_utils.py": ("data_hash", "tensor_hash", "hash_feature"),
            root / "utils" / "common.py": ("flatten_nested_list",),
        }
        namespace: dict[str, Any] = {
            "hashlib": hashlib,
            "np": np,
            "torch": torch,
            "ShmPointerMMData": type("NeverShm", (), {}),
            "CudaIpcTensorTransportProxy": type("NeverIpc", (), {}),
            "gpu_tensor_hash": None,  # CUDA tensors only
        }
        for path, names in wanted.items():
            tree = ast.parse(path.read_text(), filename=str(path))
            funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
            if {f.name for f in funcs} != set(names):
                raise ImportError(f"{path} lacks {sorted(set(names) - {f.name for f in funcs})}")
            module = ast.Module(body=list(funcs), type_ignores=[])
            exec(compile(module, str(path), "exec"), namespace)
        _HASH = namespace["hash_feature"]
    return str(_HASH(feature))
