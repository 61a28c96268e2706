"""Host -> device page loads for one step, layer by layer, overlapped with the forward.

A copy thread moves layer 0 of every queued load, sets layer 0's event, moves layer 1,
and so on; the forward waits on layer i's event just before it reads layer i's KV, so
layer i's compute runs while layer i+1 is still being copied. With layerwise=False every
layer is copied before the forward starts (the baseline the bench compares against).

`throttle_bytes_per_s` makes the copy behave like a link of that bandwidth: each layer's
copy takes at least its bytes / bandwidth (a sleep, which releases the GIL). Benches use it
to set a load/compute ratio a 2-core box's memcpy cannot reach by itself; per-layer bytes
differ (full layers carry every page, SWA layers only the window tail), like the compute.
The host pages of every load stay pinned until finish() (they cannot be evicted while
being copied); the device pages belong to the loading request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gcache.common.attention import AttentionKind
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiers.host_cache import HostCache


@dataclass
class PageLoad:
    req: object
    full: tuple[list[int], list[int]]  # (device pages, host slots)
    swa: tuple[list[int], list[int]]
    pinned: list[str]  # host page keys, unpinned at finish


class LoadBatch:
    def __init__(
        self,
        kv: DualKVCache,
        host: HostCache,
        loads: list[PageLoad],
        layerwise: bool,
        throttle_bytes_per_s: float = 0.0,
    ) -> None:
        self.kv, self.host, self.loads = kv, host, loads
        self.layerwise = layerwise
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.layers = kv.config.layers
        self._ready = [threading.Event() for _ in range(self.layers)]
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.on_finish: Callable[[LoadBatch], None] | None = None  # called with this batch once finished (stats)
        self.wait_s = 0.0  # time the forward spent waiting for layers
        self.copy_s = 0.0  # time the copies took (incl. throttle)
        self.bytes = sum(
            len(ld.full[0]) * kv.bytes_per_page(AttentionKind.FULL)
            + len(ld.swa[0]) * kv.bytes_per_page(AttentionKind.SWA)
            for ld in loads
        )

    def start(self) -> LoadBatch:
        if self.layerwise:
            self._thread = threading.Thread(target=self._copy_all, name="layer-load", daemon=True)
            self._thread.start()
        else:
            self._copy_all()
            self._raise()
        return self

    def _copy_all(self) -> None:
        t0 = time.perf_counter()
        try:
            pool = self.host.pool
            for layer in range(self.layers):
                t_layer = time.perf_counter()
                kind, j = self.kv.layer_slot[layer]
                pages = 0
                for ld in self.loads:
                    dev, slots = ld.full if kind == AttentionKind.FULL else ld.swa
                    pool.load_layer(self.kv, kind, j, dev, slots)
                    pages += len(dev)
                if self.throttle_bytes_per_s:
                    layer_bytes = pages * pool.page_bytes[kind] / max(1, pool.layers[kind])
                    left = layer_bytes / self.throttle_bytes_per_s - (time.perf_counter() - t_layer)
                    if left > 0:
                        time.sleep(left)
                self._ready[layer].set()
        except BaseException as e:  # surfaced in the engine thread by wait_layer / finish
            self._error = e
            for ev in self._ready:
                ev.set()
        finally:
            self.copy_s = time.perf_counter() - t0

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"host -> device KV load failed: {self._error!r}") from self._error

    def wait_layer(self, layer: int) -> None:
        ev = self._ready[layer]
        if not ev.is_set():
            t0 = time.perf_counter()
            ev.wait()
            self.wait_s += time.perf_counter() - t0
        self._raise()

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
        for ld in self.loads:
            self.host.unpin(ld.pinned)
        self.loads = []
        if self.on_finish is not None:
            self.on_finish(self)
        self._raise()
