"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

Every key the connector reads starts with `gcache_`; a misspelled one is an error when the
engine starts rather than a setting silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gcache.integrations.common.extra_config import URL_ENV, ExtraConfig, SettingsError
from gcache.integrations.common.store_settings import STORE_KEYS, StoreSettings
from gcache.integrations.vllm.kv.state_groups import ADMISSIONS

__all__ = ["URL_ENV", "ConnectorSettings", "SettingsError", "LAYOUTS"]

# vLLM's KVCacheLayout names. The connector moves any of them; it asks for one (the default
# LBHNC: a page is one run on CPU and GPU alike, heads are a rank's contiguous slice) unless
# the engine's own setting (--kv-cache-layout, VLLM_KV_CACHE_LAYOUT) decides first.
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass(frozen=True)
class ConnectorSettings(StoreSettings):
    """StoreSettings (url, namespace, timeouts, retries, suspect_s, skip_existing, transport,
    verify_checksums) plus the connector's own."""

    suspect_s: float = 5.0  # after a store failure, calls answer "miss" this long
    model: str | None = None  # the model's name in keys (default: vLLM's served model name)
    layout: str = "LBHNC"  # the KV layout asked of vLLM; BLHNC: all layers of a block in one run
    staging_mib: int = 256  # host staging memory (pinned on a GPU), half for saves, half for loads
    value_bytes_max: int = 64 << 20  # the node's value limit: larger values go in segments
    checkpoint_pages: int = 16  # C: sliding-window KV is kept at every C pages (and prompt ends)
    swa_every_page: bool = False  # store every sliding-window page (the benchmark's baseline)
    save_queue_jobs_max: int = 64  # steps whose puts wait; beyond: that step's saves are dropped
    load_queue_jobs_max: int = 256  # async loads waiting
    # Sync (in the step) or async (between steps) per load, from measured costs (load_choice.py);
    # a number here restores the fixed rule: hits this long load between steps, shorter in the step.
    async_load_min_tokens: int | None = None
    load_step_fraction: float = 0.5  # busy engine: a load in the step may add this much of a step
    sync_load_max_s: float = 0.25  # idle engine: a load longer than this runs between steps
    idle_wait_s: float = 0.01  # an empty step waits this long for a load in flight (report it now)
    # Direct loads: CPU KV and a same-host store (shm): values go from the store's shared memory
    # straight into the KV blocks, each checked first (one pass, no staging); prefetch is then off.
    direct_loads: bool = True
    # A prompt that ends on a page boundary loads its last page too and vLLM recomputes only its
    # last token (full-attention models only; plan.loadable_pages). False: that page is recomputed.
    load_last_page: bool = True
    # Prefetch (prefetch.py): a request's stored prefix read into staging when it arrives.
    prefetch: bool = True
    prefetch_mib: int = 256  # staging memory for prefetched values
    prefetch_requests_max: int = 32  # prefetches queued or running at once
    prefetch_wait_s: float = 2.0  # the longest a request waits for its prefetch; then recomputed
    state_boundaries_max: int = 64  # boundary states saved per request (hybrids); later offers dropped
    # Which offered states to save: "ends" (the prompt's end, decode boundaries, the branch
    # point: Marconi's placement, 1.3-2.1x LRU's reusable tokens on the traces) or "offered" (all).
    state_admission: str = "ends"
    # Tell the node each saved value's kind and recompute cost (the PUT's "worth"): off by
    # default, since on the hybrid traces the node's cost weighing does not beat recency
    # (docs/hybrid-models.md, "Which states the node keeps").
    put_worth: bool = False
    # The L3 as vLLM KV events (docs/kv-events.md): a ZMQ PUB endpoint of the scheduler's own.
    kv_events_endpoint: str | None = None  # e.g. "ipc:///tmp/gcache-l3.kv" (binds, host only); None: no events
    kv_events_topic: str | None = None  # default kv@<pod>@<model>
    kv_events_pod: str | None = None  # default the host name
    kv_events_pages_max: int = 1 << 18  # announced pages remembered (LRU); the oldest withdrawn beyond
    kv_events_queue_max: int = 4096  # notices and event batches waiting; beyond: dropped, counted
    kv_events_confirm_s: float = 30.0  # a saved page not in the store after this is never announced
    # Cumulative counters in JSON files (docs/vllm-loads.md): <dir>/scheduler.json and
    # <dir>/worker-<rank>.json, rewritten every stats_interval_s and at shutdown. None: no files.
    stats_dir: str | None = None
    stats_interval_s: float = 5.0

    KNOWN = STORE_KEYS + (
        "gcache_model",
        "gcache_layout",
        "gcache_staging_mib",
        "gcache_value_bytes_max",
        "gcache_checkpoint_pages",
        "gcache_swa_every_page",
        "gcache_save_queue_jobs_max",
        "gcache_load_queue_jobs_max",
        "gcache_async_load_min_tokens",
        "gcache_direct_loads",
        "gcache_load_last_page",
        "gcache_state_boundaries_max",
        "gcache_state_admission",
        "gcache_put_worth",
        "gcache_load_step_fraction",
        "gcache_sync_load_max_s",
        "gcache_idle_wait_s",
        "gcache_prefetch",
        "gcache_prefetch_mib",
        "gcache_prefetch_requests_max",
        "gcache_prefetch_wait_s",
        "gcache_kv_events_endpoint",
        "gcache_kv_events_topic",
        "gcache_kv_events_pod",
        "gcache_kv_events_pages_max",
        "gcache_kv_events_queue_max",
        "gcache_kv_events_confirm_s",
        "gcache_stats_dir",
        "gcache_stats_interval_s",
    )

    @property
    def staging_bytes(self) -> int:
        return self.staging_mib << 20

    @classmethod
    def from_extra_config(
        cls, extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
    ) -> ConnectorSettings:
        extra = ExtraConfig(extra_config, "kv_connector_extra_config")
        extra.check_known(cls.KNOWN, "GCacheConnector")
        layout = extra.extra.get("gcache_layout", cls.layout)
        if layout not in LAYOUTS:
            raise SettingsError(f"kv_connector_extra_config['gcache_layout'] must be one of {LAYOUTS}, got {layout!r}")
        admission = extra.extra.get("gcache_state_admission", cls.state_admission)
        if admission not in ADMISSIONS:
            raise SettingsError(
                f"kv_connector_extra_config['gcache_state_admission'] must be one of {ADMISSIONS}, got {admission!r}"
            )
        endpoint = extra.name("gcache_kv_events_endpoint")
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise SettingsError(
                "kv_connector_extra_config['gcache_kv_events_endpoint'] must be a ZMQ endpoint "
                f"(ipc://PATH, tcp://*:PORT), got {endpoint!r}"
            )
        return cls(
            **cls.store_fields(extra, environ),
            model=extra.name("gcache_model"),
            layout=layout,
            staging_mib=extra.integer("gcache_staging_mib", cls.staging_mib, 2, 1 << 20),
            value_bytes_max=extra.integer("gcache_value_bytes_max", cls.value_bytes_max, 4096, 1 << 40),
            checkpoint_pages=extra.integer("gcache_checkpoint_pages", cls.checkpoint_pages, 1, 1 << 20),
            swa_every_page=extra.flag("gcache_swa_every_page", cls.swa_every_page),
            save_queue_jobs_max=extra.integer("gcache_save_queue_jobs_max", cls.save_queue_jobs_max, 1, 1 << 16),
            load_queue_jobs_max=extra.integer("gcache_load_queue_jobs_max", cls.load_queue_jobs_max, 1, 1 << 16),
            async_load_min_tokens=(
                None
                if extra.extra.get("gcache_async_load_min_tokens") is None
                else extra.integer("gcache_async_load_min_tokens", 0, 0, 1 << 30)
            ),
            load_step_fraction=extra.number("gcache_load_step_fraction", cls.load_step_fraction, 0.0, 100.0),
            sync_load_max_s=extra.number("gcache_sync_load_max_s", cls.sync_load_max_s, 0.0, 600.0),
            idle_wait_s=extra.number("gcache_idle_wait_s", cls.idle_wait_s, 0.0, 1.0),
            direct_loads=extra.flag("gcache_direct_loads", cls.direct_loads),
            load_last_page=extra.flag("gcache_load_last_page", cls.load_last_page),
            prefetch=extra.flag("gcache_prefetch", cls.prefetch),
            prefetch_mib=extra.integer("gcache_prefetch_mib", cls.prefetch_mib, 1, 1 << 20),
            prefetch_requests_max=extra.integer("gcache_prefetch_requests_max", cls.prefetch_requests_max, 1, 1 << 16),
            prefetch_wait_s=extra.number("gcache_prefetch_wait_s", cls.prefetch_wait_s, 0.0, 600.0),
            state_admission=admission,
            put_worth=extra.flag("gcache_put_worth", cls.put_worth),
            state_boundaries_max=extra.integer("gcache_state_boundaries_max", cls.state_boundaries_max, 0, 1 << 20),
            kv_events_endpoint=endpoint,
            kv_events_topic=extra.name("gcache_kv_events_topic"),
            kv_events_pod=extra.name("gcache_kv_events_pod"),
            kv_events_pages_max=extra.integer("gcache_kv_events_pages_max", cls.kv_events_pages_max, 1, 1 << 26),
            kv_events_queue_max=extra.integer("gcache_kv_events_queue_max", cls.kv_events_queue_max, 1, 1 << 20),
            kv_events_confirm_s=extra.number("gcache_kv_events_confirm_s", cls.kv_events_confirm_s, 0.1, 86400.0),
            stats_dir=extra.name("gcache_stats_dir"),
            stats_interval_s=extra.number("gcache_stats_interval_s", cls.stats_interval_s, 0.05, 3600.0),
        )
