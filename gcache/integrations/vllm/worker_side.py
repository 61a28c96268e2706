"""The connector's worker half: vLLM's KV tensors registered once, pages saved from them on
the saver thread and loaded straight into the blocks vLLM allocated.

vLLM's CPU KV tensor of a layer is [num_blocks, kv_heads, block_size, 2 * head_size]
(contiguous; each (block, head) tile holds K then V): one block of one layer is one
contiguous run of bytes, one store value. Layers of different KV cache groups may share one
tensor (the hybrid allocator's pool); block ids are global, so a block's address is the same
arithmetic either way.
"""

from __future__ import annotations

import logging
import threading

from gcache.integrations.vllm.loader import Loader, LoadJob, load_pages
from gcache.integrations.vllm.saver import SaveJob, Saver
from gcache.wire.keys import POOL_SWA

log = logging.getLogger("gcache.integrations.vllm")
FENCE_TIMEOUT_S = 120.0  # longest a step waits for saves of blocks vLLM will reuse
CLOSE_TIMEOUT_S = 30.0
# A request vLLM says finished keeps its blocks until its saves are written; the step that
# learns it waits this long for them, so an idle engine (which takes no further steps) frees
# them now rather than at the next request. Its saves usually ended steps ago.
FINISH_WAIT_S = 0.5


class LayoutError(ValueError):
    """A KV tensor the connector cannot address (the message says what it found)."""


class LayerBlocks:
    """Where block b of one layer lives: base + b * block_bytes."""

    def __init__(self, name: str, tensor, page_bytes: int):
        if tensor.device.type != "cpu":
            raise LayoutError(f"layer {name}: GCacheConnector reads KV from CPU tensors, got {tensor.device}")
        if not tensor.is_contiguous():
            raise LayoutError(f"layer {name}: the KV tensor is not contiguous (shape {tuple(tensor.shape)})")
        self.block_bytes = tensor.stride(0) * tensor.element_size()
        if self.block_bytes != page_bytes:
            raise LayoutError(
                f"layer {name}: a block is {self.block_bytes} bytes but vLLM's spec says {page_bytes}; "
                f"the KV layout {tuple(tensor.shape)} is not [num_blocks, heads, block_size, 2 * head_size]"
            )
        self.base = tensor.data_ptr()
        self.num_blocks = tensor.shape[0]
        self.nbytes = tensor.numel() * tensor.element_size()

    def address(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise LayoutError(f"block {block_id} is outside the KV tensor ({self.num_blocks} blocks)")
        return self.base + block_id * self.block_bytes


class WorkerSide:
    def __init__(self, settings, groups, keys, client, store, stats):
        self.settings = settings
        self.groups = groups
        self.keys = keys  # this rank's PageKeys
        self.client = client
        self.store = store
        self.stats = stats
        self.layer_group = {name: g for g in groups for name in g.layer_names}
        self.layer_id = {name: lid for g in groups for name, lid in zip(g.layer_names, g.layer_ids)}
        self.layers: dict[str, LayerBlocks] = {}
        self.saver = Saver(store, stats, settings.save_queue_jobs_max, settings.skip_existing)
        self.loader = Loader(store, stats, settings.load_queue_jobs_max)
        self.saving: set[str] = set()  # requests whose saves the scheduler waits for
        self.finished_saving: set[str] = set()  # ...that vLLM says finished: report when saved
        self.load_errors: set[int] = set()
        self.async_done: set[str] = set()
        self.async_failed: set[str] = set()
        # Synchronous loads, layer by layer on one thread per step: the forward waits for
        # each layer just before its attention (wait_for_layer_load), not for all of them.
        self.layer_loaded: dict[str, threading.Event] = {}
        self.layer_thread: threading.Thread | None = None
        self.errors_lock = threading.Lock()

    # -- registration -------------------------------------------------------------------

    def register(self, kv_caches: dict) -> None:
        seen = set()
        for name, group in self.layer_group.items():
            tensor = kv_caches.get(name)
            if tensor is None:
                raise LayoutError(f"vLLM registered no KV tensor for layer {name}")
            blocks = LayerBlocks(name, tensor, group.page_bytes)
            self.layers[name] = blocks
            if blocks.base not in seen:  # the hybrid allocator's layers share tensors
                self.client.register_buffer(blocks.base, blocks.nbytes)
                seen.add(blocks.base)

    # -- jobs ---------------------------------------------------------------------------

    def _load_job(self, spec) -> LoadJob:
        keys, addresses, sizes, blocks = [], [], [], []
        for ref in spec.pages:
            group = self.groups[ref.group]
            for name, layer_id in zip(group.layer_names, group.layer_ids):
                layer = self.layers[name]
                keys.append(self.keys.key(ref.page_hash, group, layer_id))
                addresses.append(layer.address(ref.block_id))
                sizes.append(layer.block_bytes)
                blocks.append(ref.block_id)
        return LoadJob(spec.req_id, keys, addresses, sizes, blocks)

    def start_load(self, meta) -> None:
        self.finish_layer_loads()  # the last step's, if a layer was never waited for
        for spec in meta.saves:
            self.saving.add(spec.req_id)
        layered = []
        for spec in meta.loads:
            try:
                job = self._load_job(spec)
            except Exception as exc:  # a block outside the tensor: fail these pages, vLLM recomputes
                log.error("GCache connector: load of %s refused: %s", spec.req_id, exc)
                self._failed(spec, {r.block_id for r in spec.pages})
                continue
            if spec.asynchronous:
                self.loader.submit(job)
            else:
                layered.append(spec)
        if layered:
            self._start_layer_loads(layered)

    def _start_layer_loads(self, specs) -> None:
        jobs = []  # (layer name, job) in the model's layer order
        for name in sorted(self.layer_group, key=self.layer_id.get):
            group, layer_id = self.layer_group[name], self.layer_id[name]
            layer = self.layers[name]
            keys, addresses, blocks = [], [], []
            for spec in specs:
                for ref in spec.pages:
                    if ref.group == group.index:
                        keys.append(self.keys.key(ref.page_hash, group, layer_id))
                        addresses.append(layer.address(ref.block_id))
                        blocks.append(ref.block_id)
            if keys:
                jobs.append((name, LoadJob("", keys, addresses, [layer.block_bytes] * len(keys), blocks)))
        self.layer_loaded = {name: threading.Event() for name, _ in jobs}

        def run():
            for name, job in jobs:
                try:
                    failed = load_pages(self.store, self.stats, job)
                except Exception:  # our bug: these blocks failed, vLLM recomputes them
                    log.exception("GCache connector: a layer load failed")
                    failed = set(job.blocks)
                with self.errors_lock:
                    self.load_errors |= failed
                self.layer_loaded[name].set()

        self.layer_thread = threading.Thread(target=run, name="gcache-vllm-layer-loads", daemon=True)
        self.layer_thread.start()

    def wait_layer(self, layer_name: str) -> None:
        event = self.layer_loaded.get(layer_name)
        if event is not None and not event.wait(FENCE_TIMEOUT_S):
            log.error("GCache connector: layer %s not loaded in %.0fs", layer_name, FENCE_TIMEOUT_S)

    def finish_layer_loads(self) -> None:
        """Joins this step's layer loads (bounded: each store call is), so their errors are in."""
        thread, self.layer_thread = self.layer_thread, None
        if thread is not None:
            thread.join(FENCE_TIMEOUT_S)
            if thread.is_alive():  # cannot happen with bounded store calls; never serve its blocks
                log.error("GCache connector: layer loads still running after %.0fs", FENCE_TIMEOUT_S)
        self.layer_loaded = {}

    def _failed(self, spec, blocks: set) -> None:
        if spec.asynchronous:
            self.async_done.add(spec.req_id)
            if len(self.groups) > 1:
                self.async_failed.add(spec.req_id)
            else:
                self.load_errors |= blocks
        else:
            self.load_errors |= blocks

    def save_layer(self, layer_name: str, meta) -> None:
        """meta: this step's (vLLM binds it before the forward; start_load_kv may run after it)."""
        group = self.layer_group.get(layer_name)
        if group is None or not meta.saves:
            return
        for spec in meta.saves:
            self.saving.add(spec.req_id)
        layer = self.layers[layer_name]
        layer_id = self.layer_id[layer_name]
        keys, addresses, req_ids = [], [], []
        for spec in meta.saves:
            for ref in spec.pages:
                if ref.group == group.index:
                    keys.append(self.keys.key(ref.page_hash, group, layer_id))
                    addresses.append(layer.address(ref.block_id))
                    req_ids.append(spec.req_id)
        if keys:
            swa = group.kind == POOL_SWA
            # Sliding-window blocks leave the window and go back to vLLM's pool: the step waits.
            self.saver.submit(SaveJob(keys, addresses, [layer.block_bytes] * len(keys), tuple(req_ids), swa, swa))

    def wait_for_save(self) -> None:
        self.finish_layer_loads()  # before vLLM asks for this step's load errors
        self.saver.wait_volatile(FENCE_TIMEOUT_S)

    def preempted(self, meta) -> None:
        if meta.preempted:  # their blocks are freed and reused from this step on
            self.saver.wait_all(FENCE_TIMEOUT_S)

    # -- reports ------------------------------------------------------------------------

    def transfer_results(self, finished_req_ids) -> tuple[set, set, set]:
        """(finished sending, finished receiving, failed receiving)."""
        just_finished = set(finished_req_ids) & self.saving
        if just_finished:
            self.saver.wait_for(just_finished, FINISH_WAIT_S)
        self.finished_saving |= just_finished
        sent = {r for r in self.finished_saving if self.saver.pending(r) == 0}
        self.finished_saving -= sent
        self.saving -= sent
        for req_id, failed in self.loader.take_done():
            self.async_done.add(req_id)
            if failed:
                if len(self.groups) > 1:
                    self.async_failed.add(req_id)
                else:
                    self.load_errors |= failed
        recving, self.async_done = self.async_done, set()
        failed_recving, self.async_failed = self.async_failed, set()
        return sent, recving, failed_recving

    def take_load_errors(self) -> set[int]:
        with self.errors_lock:
            errors, self.load_errors = self.load_errors, set()
        return errors

    def flush(self, timeout_s: float) -> bool:
        """Waits (bounded) until every queued save is written: before a process exits."""
        return self.saver.wait_all(timeout_s)

    def close(self) -> None:
        self.finish_layer_loads()
        self.saver.wait_all(CLOSE_TIMEOUT_S)
        self.saver.close(CLOSE_TIMEOUT_S)
        self.loader.close(CLOSE_TIMEOUT_S)
