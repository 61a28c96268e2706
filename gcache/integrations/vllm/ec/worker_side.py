"""The encoder cache's worker half: puts fetched embeddings into vLLM's encoder cache and
writes the ones vLLM's encoder just computed.

Loads: the scheduler already read, checksummed and header-checked each value (its bytes come
in this step's metadata), so a load is a copy into a tensor on the worker's device (on CPU,
the tensor is the value's own memory).

Saves: `save_caches` runs right after vLLM's encoder produced an item. The output is copied
to host (a CPU tensor is held as is, vLLM never writes an encoder output after it is made),
and at the end of the step the step's items go to a bounded queue (JobQueue) as one job:
one existence check (skip_existing) and one batched put, header and payload in one value. A
full queue or more than `save_bytes` waiting drops that step's items (counted): saving is
best effort, the engine never waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from gcache.integrations.common.job_queue import JobQueue
from gcache.integrations.vllm.ec.value import HEADER_BYTES, Header, encode_header

if TYPE_CHECKING:
    from gcache.integrations.common.guarded_store import GuardedStore
    from gcache.integrations.vllm.ec.keys import ItemSpec
    from gcache.integrations.vllm.ec.scheduler_side import Loaded
    from gcache.integrations.vllm.ec.settings import ECSettings
    from gcache.integrations.vllm.ec.stats import ECStats

log = logging.getLogger("gcache.integrations.vllm.ec")

RECENT_KEYS = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_tensor(value: np.ndarray, header: Header, device: str | torch.device) -> torch.Tensor:
    """The embedding inside a fetched value (header + payload), on `device`."""
    payload = torch.from_numpy(value[HEADER_BYTES : HEADER_BYTES + header.payload_bytes])
    tensor = payload.view(getattr(torch, header.dtype)).reshape(header.shape)
    if torch.device(device).type != "cpu":
        tensor = tensor.to(device)
    return tensor


def value_of(key_header: bytes, tensor: torch.Tensor) -> np.ndarray:
    """Header + the tensor's bytes as one buffer (a host tensor)."""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    value = np.empty(HEADER_BYTES + flat.nbytes, dtype=np.uint8)
    value[:HEADER_BYTES] = np.frombuffer(key_header, dtype=np.uint8)
    value[HEADER_BYTES:] = flat
    return value


class _Save(NamedTuple):
    key: bytes
    header: bytes
    tensor: torch.Tensor  # on host
    nbytes: int


class ECWorkerSide:
    def __init__(
        self,
        settings: ECSettings,
        store: GuardedStore | None,
        stats: ECStats,
        save: bool,
        device: str | torch.device | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.stats = stats
        self.save_enabled = save and store is not None
        self._device = device
        self._step: list[_Save] = []
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._warned: set[tuple[object, ...]] = set()
        self.recent_keys: deque[bytes] = deque(maxlen=RECENT_KEYS)  # the last keys written (reports, tests)
        self._jobs = (
            JobQueue("gcache-ec-save", self._run, settings.save_queue_jobs_max, log) if self.save_enabled else None
        )

    @property
    def device(self) -> str | torch.device:
        if self._device is None:
            from vllm.platforms import current_platform

            device = current_platform.device_type
            if current_platform.is_cuda_alike():
                device = f"{device}:{current_platform.current_device()}"
            self._device = device
        return self._device

    # -- loads ----------------------------------------------------------------------------

    def load(self, loads: dict[str, Loaded], encoder_cache: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for identifier, loaded in loads.items():
            if identifier in encoder_cache:
                continue
            encoder_cache[identifier] = to_tensor(loaded.value, loaded.header, self.device)
            self.stats.count("items_loaded")
            self.stats.count("bytes_loaded", loaded.header.payload_bytes)
        if loads:
            self.stats.count("load_s", time.perf_counter() - t0)

    # -- saves ------------------------------------------------------------------------------

    def save(self, saves: dict[str, ItemSpec], encoder_cache: dict[str, torch.Tensor], identifier: str) -> None:
        """vLLM's encoder just produced `identifier`: queue it for the store if planned."""
        self.stats.count("encoder_outputs")
        if not self.save_enabled:
            return
        spec = saves.get(identifier)
        tensor = encoder_cache.get(identifier)
        if spec is None or tensor is None:
            return
        dtype = dtype_name(tensor.dtype)
        if dtype != spec.dtype or tensor.dim() < 2 or tensor.shape[0] != spec.rows or tensor.shape[-1] != spec.width:
            self.stats.count("saves_mismatch")
            what = (dtype, tuple(tensor.shape), spec.dtype, spec.rows, spec.width)
            if what not in self._warned and len(self._warned) < 16:
                self._warned.add(what)
                log.warning(
                    "GCacheECConnector: an encoder output is %s %s, the key expects %s [%d, %d]: not saved",
                    *what,
                )
            return
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            fits = self._pending_bytes + nbytes <= self.settings.save_bytes
            if fits:
                self._pending_bytes += nbytes
        if not fits:
            self.stats.count("saves_dropped")
            return
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")
        self._step.append(_Save(spec.key, encode_header(dtype, tuple(tensor.shape)), host, nbytes))

    def end_step(self) -> None:
        """Queues the step's items as one job (vLLM calls get_finished at every step's end)."""
        if not self._step or self._jobs is None:  # items are staged only when saves are on
            return
        job, self._step = self._step, []
        if not self._jobs.submit(job):
            self.stats.count("saves_dropped", len(job))
            self._unpend(sum(s.nbytes for s in job))

    def _run(self, job: list[_Save]) -> None:
        if self.store is None:
            raise RuntimeError("GCacheECConnector worker: a save job ran without a store")
        t0 = time.perf_counter()
        try:
            if self.settings.skip_existing:
                there = self.store.exists_flags([s.key for s in job])
                skipped = sum(1 for t in there if t)
                if skipped:
                    self.stats.count("saves_skipped_existing", skipped)
                job_to_put = [s for s, t in zip(job, there) if not t]
            else:
                job_to_put = job
            if job_to_put:
                values = [value_of(s.header, s.tensor) for s in job_to_put]
                ok = self.store.put_from([s.key for s in job_to_put], values)
                for s, done, value in zip(job_to_put, ok, values):
                    if done:
                        self.recent_keys.append(s.key)
                        self.stats.count("items_saved")
                        self.stats.count("bytes_saved", value.nbytes)
                    else:
                        self.stats.count("saves_failed")
        finally:
            self._unpend(sum(s.nbytes for s in job))
            self.stats.count("save_s", time.perf_counter() - t0)

    def _unpend(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Queues this step's items and waits (bounded) until every queued save ran."""
        if self._jobs is None:
            return True
        self.end_step()
        return self._jobs.wait_idle(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._jobs is not None:
            self.end_step()
            self._jobs.close(timeout_s)
