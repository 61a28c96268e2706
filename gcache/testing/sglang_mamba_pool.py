"""SGLang 0.5.23's Mamba host pool (`MambaPoolHost`) on the CPU, for the tests.

As with the MHA pool (sglang_modules.HostPoolStandIn), SGLang's module cannot be imported
on a CPU-only machine with `sglang --no-deps` (pool_host/mamba.py imports sglang.srt.utils,
which imports transformers and the GPU kernels). The stand-in runs SGLang's *own* code for
everything the GCache backend touches: `init_kv_buffer`, `get_page_buffer_meta`,
`get_hybrid_pool_buffer`, `get_data_page`, `get_size_per_token` and their helpers are
compiled from the installed `sglang/srt/mem_cache/pool_host/mamba.py`, unchanged; only the
constructor (the device pool plumbing) is this file's.
"""

from __future__ import annotations

from typing import Any

from gcache.testing.sglang_modules import BorrowingStandIn, borrowed_methods

BORROWED = (
    "init_kv_buffer",
    "get_page_buffer_meta",
    "get_hybrid_pool_buffer",
    "_iter_page_tensors",
    "_flatten_tensor_bytes",
    "get_data_page",
    "get_size_per_token",
)


def _borrowed_methods() -> dict[str, Any]:
    import numpy as np
    import torch

    def alloc_cpu(dims: Any, *, dtype: Any, device: Any, pin_memory: bool, allocator: Any, **_: Any) -> Any:
        return torch.zeros(dims, dtype=dtype, device=device)

    namespace: dict[str, Any] = {"torch": torch, "np": np, "ALLOC_MEMORY_FUNCS": {"cpu": alloc_cpu}}
    return borrowed_methods("mamba.py", "MambaPoolHost", BORROWED, namespace)


class MambaHostPoolStandIn(BorrowingStandIn):
    """A Mamba host pool (one state slot per page) with SGLang's own page code."""

    init_kv_buffer: Any  # set from SGLang's source on the first construction
    borrow = staticmethod(_borrowed_methods)

    def __init__(
        self,
        *,
        slots: int,
        layers: int = 2,
        temporal_shape: tuple[int, ...] = (4, 8, 16),  # heads, head dim, state size
        conv_shape: tuple[int, ...] = (3, 48),  # conv kernel - 1, channels
        dtype: Any = None,
        conv_dtype: Any = None,
        layout: str = "page_first",
    ) -> None:
        import numpy as np
        import torch

        self.layout = layout
        self.page_size = 1
        self.size = slots
        self.page_num = slots
        self.num_mamba_layers = layers
        self.temporal_state_shape = torch.Size(temporal_shape)
        self.conv_state_shapes = [torch.Size(conv_shape)]
        self.temporal_state_elem_size = int(np.prod(temporal_shape))
        self.conv_state_elem_sizes = [int(np.prod(conv_shape))]
        self.temporal_dtype = dtype or torch.float32
        self.conv_dtype = self.dtype = conv_dtype or torch.bfloat16
        self.slot_state_device_tensors: list[Any] = []
        self.device = "cpu"
        self._buffer_device = torch.device("cpu")
        self.pin_memory = False
        self.allocator = None
        self.size_per_token = self.get_size_per_token()
        self.kv_buffer = self.init_kv_buffer()

    def get_size_per_token(self) -> int:  # replaced by SGLang's on construction
        raise NotImplementedError

    def slot_indices(self, slots: list[int]) -> Any:
        import torch

        return torch.tensor(slots, dtype=torch.int64)
