"""GCacheConnector: GCache as vLLM's KV connector (vLLM 0.32), hybrid models included.

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="GCacheConnector", kv_connector_module_path="gcache.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={"gcache_url": "127.0.0.1:7600"}))

vLLM builds one instance in the scheduler (role SCHEDULER: scheduler_side.SchedulerSide)
and one per worker (role WORKER: worker_side.WorkerSide). Both reach the store in the
constructor, so an unreachable store or a bad setting is a clear error when the engine
starts. From then on no hook raises into vLLM: a store failure is a miss or a failed load
(vLLM recomputes), never wrong KV. `kv_producer` only saves, `kv_consumer` only loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from gcache.common.attention import AttentionKind
from gcache.integrations.common.connect import connect
from gcache.integrations.common.engine_boundary import EngineBoundary
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.common.stats_file import StatsFile
from gcache.integrations.vllm.events.setup import L3Events, l3_events
from gcache.integrations.vllm.interval_stats import SummedIntervalStats
from gcache.integrations.vllm.kv import link
from gcache.integrations.vllm.kv.groups import groups_of, required
from gcache.integrations.vllm.kv.keys import PageKeys, rank_keys
from gcache.integrations.vllm.kv.meta import GCacheConnectorMetadata, GCacheHandshake
from gcache.integrations.vllm.kv.scheduler_side import SchedulerSide
from gcache.integrations.vllm.kv.settings import LAYOUTS, ConnectorSettings
from gcache.integrations.vllm.kv.stats import ConnectorStats
from gcache.integrations.vllm.kv.worker_side import WorkerSide

if TYPE_CHECKING:  # vLLM's and torch's types: Any to the type check (not installed in .venv)
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("gcache.integrations.vllm")
T = TypeVar("T")


def _external_hash(h: bytes) -> int | bytes:
    """A block hash as vLLM's own KV events carry it (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: int | bytes = maybe_convert_block_hash(h)
    return out


def _warn_state_retention(groups: list[Any], vllm_config: VllmConfig) -> None:
    """vLLM's default prefix_cache_retention_interval (0) keeps, and offers, only a prompt's last
    boundary state: states reached while decoding are never saved (continuations miss)."""
    interval = getattr(vllm_config.cache_config, "prefix_cache_retention_interval", None)
    if interval == 0 and any(g.kind == AttentionKind.STATE for g in groups):
        log.warning(
            "GCacheConnector: prefix_cache_retention_interval=0 offers no decode-time Mamba states; "
            "set it to None so a continuation can hit past its first prompt"
        )


@dataclass
class GCacheConnectorStats(SummedIntervalStats, KVConnectorStats):
    """Counter changes over an interval (sums when vLLM aggregates workers or intervals)."""


class GCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        config = required(kv_cache_config)
        self.groups = groups_of(config)
        model_config = vllm_config.model_config
        model = self.settings.model or model_config.served_model_name or model_config.model
        if isinstance(model, (list, tuple)):
            model = model[0]
        is_mla = bool(getattr(model_config, "use_mla", False))
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.stats = ConnectorStats()
        self._safely = EngineBoundary(
            "GCacheConnector", log, lambda: self.stats.count("store_errors")
        )  # every engine hook: never raises into it
        self.client = connect(self.settings, "GCacheConnector")
        self.store = GuardedStore(self.client, self.settings.suspect_s, self.stats, log, remove_corrupt=True)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self.events: L3Events | None = None
        self.block_pool: BlockPool | None = None  # vLLM's, on the scheduler side (prefetch skips what it holds)
        engine_id = str(transfer.engine_id)  # the same for both halves of one engine
        if role == KVConnectorRole.SCHEDULER:
            _warn_state_retention(self.groups, vllm_config)
            if transfer.kv_load_failure_policy != "recompute":
                # A cache miss is never a request error: vLLM reads the policy right after
                # building this connector, so set it here.
                log.info("GCacheConnector: kv_load_failure_policy=recompute (a failed load is recomputed)")
                transfer.kv_load_failure_policy = "recompute"
            self.events = l3_events(self.settings, self.store, model)
            self.scheduler_side = SchedulerSide(
                self.settings,
                self.groups,
                rank_keys(model, self.settings.namespace, tp_size, is_mla),
                self.store,
                self.stats,
                load=transfer.is_kv_consumer,
                save=transfer.is_kv_producer,
                events=self.events.source if self.events is not None else None,
                hash_of=_external_hash,
                find_link=lambda: link.find(engine_id),
                register_buffer=self.client.register_buffer,
            )
        else:
            rank = self._rank(tp_size)
            keys = PageKeys(model, self.settings.namespace, rank, tp_size, is_mla)
            self.worker_side = WorkerSide(
                self.settings,
                self.groups,
                keys,
                self.client,
                self.store,
                self.stats,
                config.num_blocks,
                engine_id,
                steps_scheduled_ahead=1 if getattr(vllm_config.scheduler_config, "async_scheduling", False) else 0,
            )
        self.stats_file: StatsFile | None = None
        if self.settings.stats_dir is not None:
            name = "scheduler.json" if role == KVConnectorRole.SCHEDULER else f"worker-{self._rank(tp_size)}.json"
            path = Path(self.settings.stats_dir) / name
            self.stats_file = StatsFile(path, self.counters, self.settings.stats_interval_s, log)
        log.info(
            "GCacheConnector (%s): store %s, groups %s, keys ...%s",
            role.name,
            self.settings.url,
            [f"{g.kind}:{len(g.layer_names)}" for g in self.groups],
            rank_keys(model, self.settings.namespace, 1, is_mla)[0].builder.suffix,
        )

    @staticmethod
    def _rank(tp_size: int) -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return 0 if tp_size == 1 else get_tensor_model_parallel_rank()

    # -- the boundary: nothing raises into vLLM ---------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout GCache asks of vLLM (gcache_layout, default LBHNC); the engine's own
        setting wins, and the connector moves whatever vLLM resolved."""
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        layout = extra.get("gcache_layout", ConnectorSettings.layout)
        return layout if layout in LAYOUTS else None  # a bad value fails at the connector's start

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    def counters(self) -> dict[str, float]:
        """This half's totals since it started: the counters (stats.py), the store calls per
        value by outcome (guarded_store.WIRE_COUNTERS), and gauges (what is held now)."""
        gauges = self.scheduler_side.gauges() if self.scheduler_side is not None else {}
        transfers = self.worker_side.transfers if self.worker_side is not None else None
        if transfers is not None:
            gauges["saves_pending"] = transfers.saver.pending()  # steps whose puts are not done
        return {**self.stats.snapshot(), **self.store.wire.snapshot(), **gauges}

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Worker side: waits (bounded) for every queued save; True when all were written.
        vLLM's shutdown() does it too; a process that exits without it loses queued saves."""
        return self.worker_side is None or self.worker_side.flush(timeout_s)

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("GCacheConnector: a scheduler-side hook was called on a worker's connector")
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("GCacheConnector: a worker-side hook was called on the scheduler's connector")
        return self.worker_side

    # -- scheduler side ----------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.block_pool = gpu_block_pool

    def on_new_request(self, request: Request) -> None:
        """The earliest hook: the prefix's read starts now, past what vLLM holds itself."""
        self._safely("arrival", None, self._scheduler().arrived, request, self._local_pages(request))

    def _local_pages(self, request: Request) -> int:
        """Leading prompt pages vLLM's own prefix cache holds for every group (0 when its
        block hashes are not one per page)."""
        pool, hashes = self.block_pool, getattr(request, "block_hashes", None)
        block_size = self.groups[0].block_size
        if pool is None or not isinstance(hashes, list) or len(hashes) != request.num_tokens // block_size:
            return 0
        group_ids = [g.index for g in self.groups]
        pages = 0
        for h in hashes:
            if pool.get_cached_block(h, group_ids) is None:
                break
            pages += 1
        return pages

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        miss: tuple[int | None, bool] = (0, False)
        return self._safely("lookup", miss, self._scheduler().matched_tokens, request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # A failure here would leave vLLM waiting for tokens nobody loads: plan no load, and
        # the worker reports nothing for it... so this must not fail; _safely logs if it does.
        self._safely("alloc", None, self._scheduler().after_alloc, request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> GCacheConnectorMetadata:
        return self._safely("meta", GCacheConnectorMetadata(), self._scheduler().build_meta, scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._safely("worker output", None, self._scheduler().worker_output, connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._safely("finish", False, self._scheduler().finished, request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._safely("finish", False, self._scheduler().finished, request), None

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)  # a layout we cannot address fails the start

    def get_handshake_metadata(self) -> GCacheHandshake | None:
        side = self.worker_side
        return GCacheHandshake(side.handshake(), dict(side.value_bytes)) if side is not None else None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self.scheduler_side is not None:
            tags = {rank: m.tags for rank, m in metadata.items() if isinstance(m, GCacheHandshake)}
            for m in metadata.values():
                if isinstance(m, GCacheHandshake):
                    self.scheduler_side.value_bytes = dict(m.value_bytes)
            self.scheduler_side.set_tags(tags)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, GCacheConnectorMetadata):
            self._safely("preemption", None, self._worker().preempted, kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, GCacheConnectorMetadata):
            self._safely("load", None, self._worker().start_load, meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a synchronous load's copy is ordered before the forward on the
        compute stream (start_load_kv), so no layer hook and no cudagraph restriction."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: a value holds all of a group's layers, saved in wait_for_save."""

    def wait_for_save(self) -> None:
        # The step's forward is queued: its pages are saved from this step's metadata, before
        # a sliding-window block can belong to another request (the next step).
        meta = self._connector_metadata
        if isinstance(meta, GCacheConnectorMetadata):
            self._safely("save", None, self._worker().save_step, meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        nothing: tuple[set[str], set[str], set[str]] = (set(), set(), set())
        meta = self._connector_metadata
        ours = isinstance(meta, GCacheConnectorMetadata)
        idle = ours and meta.idle
        wait_s = meta.load_wait_s if ours else 0.0
        sent, recving, failed = self._safely(
            "results", nothing, self._worker().transfer_results, finished_req_ids, idle, wait_s
        )
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._safely("load errors", set(), self._worker().take_load_errors)

    def get_kv_connector_stats(self) -> GCacheConnectorStats | None:
        delta = self.stats.delta()
        return GCacheConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> GCacheConnectorStats:
        return GCacheConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self._safely("prefetch", None, self.scheduler_side.close)
        if self.events is not None:
            self._safely("events", None, self.events.close)
        if self.worker_side is not None:
            self._safely("shutdown", None, self.worker_side.close)
        if self.stats_file is not None:  # after the saves' last puts
            self._safely("stats file", None, self.stats_file.close)
        self.client.close()
