"""GCacheECConnector: GCache as vLLM's encoder-cache connector (vLLM 0.32, ECConnectorBase).

    LLM(model=..., ec_transfer_config=ECTransferConfig(
        ec_connector="GCacheECConnector", ec_connector_module_path="gcache.integrations.vllm",
        ec_role="ec_both", ec_connector_extra_config={"gcache_url": "127.0.0.1:7600"}))

vLLM builds one instance in the scheduler (role SCHEDULER: scheduler_side.ECSchedulerSide)
and one per worker (role WORKER: worker_side.ECWorkerSide). The scheduler's reaches the
store in the constructor (so does a producer's TP rank 0 worker, the one that writes: every
rank holds the same encoder outputs, and loads reach every rank in the step's metadata), so an unreachable store or a bad
setting is a clear error when the engine starts. From then on no hook raises into vLLM: a
store failure is a miss and vLLM's encoder runs. Roles: `ec_producer` writes what its
encoder computes (and skips encoding items the store has), `ec_consumer` reads, `ec_both`
does both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from gcache.integrations.common.connect import connect
from gcache.integrations.common.engine_boundary import EngineBoundary
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.vllm.ec.keys import ItemKeys
from gcache.integrations.vllm.ec.scheduler_side import ECSchedulerSide
from gcache.integrations.vllm.ec.settings import ECSettings
from gcache.integrations.vllm.ec.stats import ECStats
from gcache.integrations.vllm.interval_stats import SummedIntervalStats

if TYPE_CHECKING:  # vLLM's and torch's types: Any to the type check (not installed in .venv)
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from gcache.client import Client
    from gcache.integrations.vllm.ec.keys import ItemSpec
    from gcache.integrations.vllm.ec.scheduler_side import Loaded
    from gcache.integrations.vllm.ec.worker_side import ECWorkerSide

log = logging.getLogger("gcache.integrations.vllm.ec")
T = TypeVar("T")


@dataclass
class GCacheECMetadata(ECConnectorMetadata):
    """This step's items: `loads` identifier -> scheduler_side.Loaded (the fetched value),
    `saves` identifier -> keys.ItemSpec (what vLLM encodes this step and a producer writes)."""

    loads: dict[str, Loaded] = field(default_factory=dict)
    saves: dict[str, ItemSpec] = field(default_factory=dict)


@dataclass
class GCacheECConnectorStats(SummedIntervalStats, ECConnectorStats):
    """Counter changes over an interval (sums when vLLM aggregates workers or intervals)."""


def model_identity(settings: ECSettings, model_config: Any) -> str:
    """gcache_model, else the served model name, else the model string."""
    model = settings.model or model_config.served_model_name or model_config.model
    if isinstance(model, (list, tuple)):
        model = model[0]
    return str(model)


def item_keys(vllm_config: VllmConfig, settings: ECSettings) -> ItemKeys:
    model_config = vllm_config.model_config
    mm_config = model_config.multimodal_config
    ec_config = vllm_config.ec_transfer_config
    return ItemKeys(
        model=model_identity(settings, model_config),
        namespace=settings.namespace,
        dtype=str(model_config.dtype).removeprefix("torch."),
        widths=dict(ec_config.mm_encoder_output_widths or {}),
        default_width=model_config.get_inputs_embeds_size(),
        encoder_hash=mm_config.compute_hash() if mm_config is not None else None,
    )


def _tp_rank(vllm_config: VllmConfig) -> int:
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class GCacheECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        self.settings = ECSettings.from_extra_config(ec_config.ec_connector_extra_config)
        self.stats = ECStats()
        self._safely = EngineBoundary(
            "GCacheECConnector", log, lambda: self.stats.count("store_errors")
        )  # every engine hook: never raises into it
        self.client: Client | None = None
        self.store: GuardedStore | None = None
        self.scheduler_side: ECSchedulerSide | None = None
        self.worker_side: ECWorkerSide | None = None
        # Every TP rank holds the same encoder outputs: rank 0 alone writes them.
        writes = self.is_producer and (role == ECConnectorRole.WORKER and _tp_rank(vllm_config) == 0)
        if role == ECConnectorRole.SCHEDULER or writes:
            self.client = connect(self.settings, "GCacheECConnector")
            self.store = GuardedStore(self.client, self.settings.suspect_s, self.stats, log, remove_corrupt=True)
        if role == ECConnectorRole.SCHEDULER:
            if self.store is None:
                raise RuntimeError("GCacheECConnector: the scheduler's connector has no store")
            keys = item_keys(vllm_config, self.settings)
            self.scheduler_side = ECSchedulerSide(
                self.settings, keys, self.store, self.stats, load=self.is_consumer, save=self.is_producer
            )
            log.info(
                "GCacheECConnector (%s, %s): store %s, keys ...%s",
                role.name,
                ec_config.ec_role,
                self.settings.url,
                keys.key("0" * 64, "image")[64:].decode(),
            )
        else:
            from gcache.integrations.vllm.ec.worker_side import ECWorkerSide

            self.worker_side = ECWorkerSide(self.settings, self.store, self.stats, save=writes)

    # -- the boundary: nothing raises into vLLM ---------------------------------------------

    def _scheduler(self) -> ECSchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("GCacheECConnector: a scheduler-side hook was called on a worker's connector")
        return self.scheduler_side

    def _worker(self) -> ECWorkerSide:
        if self.worker_side is None:
            raise RuntimeError("GCacheECConnector: a worker-side hook was called on the scheduler's connector")
        return self.worker_side

    # -- scheduler side ---------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        return self._safely("has_cache_item", False, self._scheduler().has_cache_item, identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self._safely(
            "ensure_cache_available", True, self._scheduler().ensure_cache_available, request, num_computed_tokens
        )

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._safely("update_state_after_alloc", None, self._scheduler().update_state_after_alloc, request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> GCacheECMetadata:
        step = self._safely(
            "build_connector_meta",
            None,
            self._scheduler().build_step,
            scheduler_output.scheduled_encoder_inputs or {},
        )
        loads, saves = step or ({}, {})
        return GCacheECMetadata(loads=loads, saves=saves)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._safely("request_finished", None, self._scheduler().request_finished, request)
        return False, None

    # -- worker side --------------------------------------------------------------------------

    def _meta(self) -> GCacheECMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, GCacheECMetadata) else None

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.loads:
            # Not _safely: an item vLLM was told is here must be here (a failure is vLLM's
            # "encoder cache miss" error either way, better raised where it happened).
            self._worker().load(meta.loads, encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        meta = self._meta()
        saves = meta.saves if meta is not None else {}
        self._safely("save_caches", None, self._worker().save, saves, encoder_cache, mm_hash)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is not None:
            self._safely("get_finished", None, self.worker_side.end_step)
        return None, None

    # -- both ------------------------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        return self.stats.snapshot()

    def recent_saved_keys(self) -> list[bytes]:
        """The last keys this worker wrote (at most worker_side.RECENT_KEYS)."""
        return list(self.worker_side.recent_keys) if self.worker_side is not None else []

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits (bounded) for queued saves and reads (tests; vLLM never calls it)."""
        if self.worker_side is not None:
            return self.worker_side.flush(timeout_s)
        if self.scheduler_side is not None:
            return self.scheduler_side.wait_idle(timeout_s)
        return True

    def get_ec_connector_stats(self) -> GCacheECConnectorStats | None:
        delta = self.stats.delta()
        return GCacheECConnectorStats(data=delta) if delta else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> GCacheECConnectorStats:
        return GCacheECConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self._safely("shutdown", None, self.worker_side.close)
        if self.scheduler_side is not None:
            self._safely("shutdown", None, self.scheduler_side.close)
        if self.client is not None:
            self.client.close()
