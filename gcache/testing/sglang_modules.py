"""SGLang's storage modules without SGLang's server, for the tests and the benchmark.

`load_sglang_storage()` registers the `sglang` package without running its
`__init__` (which imports SGLang's whole serving stack: CUDA kernels,
transformers, ...); `sglang.srt.mem_cache.hicache_storage` and
`.storage.backend_factory` import only torch and the standard library.

`HostPoolStandIn`: SGLang's real `MHATokenToKVPoolHost` cannot be built on a
CPU-only machine with `sglang --no-deps` (its module imports SGLang's attention
layers, distributed runtime and GPU kernels: triton, tvm-ffi, transformers,
torchvision, which in turn needs another torch). The stand-in therefore runs
SGLang's *own* code for everything the backend touches: the methods
`init_kv_buffer`, `get_page_buffer_meta`, `get_data_page`,
`get_dummy_flat_data_page`, `set_from_flat_data_page`, `get_hybrid_pool_buffer`
and the `k_buffer` / `v_buffer` properties are compiled from the installed
`sglang/srt/mem_cache/pool_host/mha.py`, unchanged; only the constructor (device
pool plumbing) is this file's.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
BORROWED = (
    "init_kv_buffer",
    "get_page_buffer_meta",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
    "get_hybrid_pool_buffer",
    "get_size_per_token",
    "get_ksize_per_token",
    "k_buffer",
    "v_buffer",
)


def sglang_root() -> Path | None:
    """The installed sglang package's folder (found without importing it), or None."""
    module = sys.modules.get("sglang")
    if module is not None:
        return Path(list(module.__path__)[0])
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def load_sglang_storage() -> tuple[types.ModuleType, Any]:
    """(hicache_storage module, StorageBackendFactory); registers `sglang` without its __init__."""
    if "sglang" not in sys.modules:
        root = sglang_root()
        if root is None:
            raise ImportError(f"sglang is not installed (pip install --no-deps sglang=={SGLANG_VERSION})")
        package = types.ModuleType("sglang")
        package.__path__ = [str(root)]
        package.__package__ = "sglang"
        package.__file__ = str(root / "__init__.py")
        sys.modules["sglang"] = package
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return hicache_storage, StorageBackendFactory


def borrowed_methods(source: str, class_name: str, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Any]:
    """Methods `names` of SGLang's class `class_name` in srt/mem_cache/pool_host/`source`,
    compiled from its installed source into `namespace` (the globals they need)."""
    root = sglang_root()
    if root is None:
        raise ImportError(f"sglang is not installed (pip install --no-deps sglang=={SGLANG_VERSION})")
    path = root / "srt" / "mem_cache" / "pool_host" / source
    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    funcs = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {f.name for f in funcs}
    if missing:
        raise ImportError(f"sglang's {class_name} has no {sorted(missing)}: not sglang {SGLANG_VERSION}?")
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    module = ast.Module(body=[future, *funcs], type_ignores=[])
    ast.fix_missing_locations(module)
    exec(compile(module, str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}  # decorators (@property) kept


def _borrowed_methods() -> dict[str, Any]:
    """SGLang's MHATokenToKVPoolHost methods, compiled from its installed source."""
    import torch

    def alloc_cpu(
        dims: Any, dtype: Any, device: Any, pin_memory: bool, allocator: Any, registration_granularity_bytes: Any = None
    ) -> Any:
        return torch.zeros(dims, dtype=dtype, device=device)

    namespace: dict[str, Any] = {"torch": torch, "ALLOC_MEMORY_FUNCS": {"cpu": alloc_cpu}, "PageUnifiedLayout": None}
    return borrowed_methods("mha.py", "MHATokenToKVPoolHost", BORROWED, namespace)


class BorrowingStandIn:
    """A stand-in whose page methods are SGLang's own, set on the class from SGLang's
    source (`borrow()`) when the first one is built (SGLang may be absent at import)."""

    @staticmethod
    def borrow() -> dict[str, Any]:
        raise NotImplementedError

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls.__dict__.get("_borrowed", False):
            for name, method in cls.borrow().items():
                setattr(cls, name, method)
            cls._borrowed = True
        return super().__new__(cls)


class HostPoolStandIn(BorrowingStandIn):
    """An MHA host pool on the CPU, with SGLang's own page arithmetic (see module doc)."""

    # set from SGLang's source on the first construction (BORROWED); declared for the type checker
    init_kv_buffer: Callable[[], Any]
    borrow = staticmethod(_borrowed_methods)

    def __init__(
        self,
        *,
        layout: str,
        page_size: int,
        pages: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        dtype: Any = None,
        label: str = "kv",
    ) -> None:
        import torch

        self.layout = layout
        self.page_size = page_size
        self.page_num = pages
        self.size = pages * page_size
        self.layer_num = self.target_layer_num = layer_num
        self.head_num = head_num
        self.head_dim = self.v_head_dim = head_dim
        self.dtype = dtype or torch.bfloat16
        self.device = "cpu"
        self._transfer_device = torch.device("cpu")
        self.pin_memory = False
        self.allocator = None
        self.pool_label = label
        self.kv_buffer = self.init_kv_buffer()

    def page_slots(self, page: int) -> Any:
        """Host indices (token slots) of page number `page`."""
        import torch

        return torch.arange(page * self.page_size, (page + 1) * self.page_size, dtype=torch.int64)
