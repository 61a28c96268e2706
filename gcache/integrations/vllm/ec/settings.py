"""GCacheECConnector's settings, read from vLLM's `ec_connector_extra_config`.

Every key it reads starts with `gcache_`; a misspelled one is an error when the engine starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gcache.integrations.common.extra_config import ExtraConfig
from gcache.integrations.common.store_settings import STORE_KEYS, StoreSettings

LABEL = "ec_connector_extra_config"


@dataclass(frozen=True)
class ECSettings(StoreSettings):
    """StoreSettings (url, namespace, timeouts, retries, suspect_s, skip_existing, transport,
    verify_checksums) plus the encoder cache's own."""

    suspect_s: float = 5.0  # after a store failure, calls answer "miss" this long
    model: str | None = None  # the model's name in keys (default: vLLM's served model name)
    prefetch_mib: int = 256  # fetched embeddings the scheduler holds for requests not yet run
    wait_ms: float = 5.0  # per step, the longest the scheduler waits for fetches in the step
    defer_s: float = 5.0  # the longest a request waits for its items; then its encoder runs
    save_mib: int = 256  # host copies of encoder outputs waiting to be written
    save_queue_jobs_max: int = 64  # steps whose writes wait; beyond: that step's items are not saved
    fetch_queue_jobs_max: int = 256  # requests whose fetches wait; beyond: their items are encoded

    KNOWN = STORE_KEYS + (
        "gcache_model",
        "gcache_prefetch_mib",
        "gcache_wait_ms",
        "gcache_defer_s",
        "gcache_save_mib",
        "gcache_save_queue_jobs_max",
        "gcache_fetch_queue_jobs_max",
    )

    @property
    def prefetch_bytes(self) -> int:
        return self.prefetch_mib << 20

    @property
    def save_bytes(self) -> int:
        return self.save_mib << 20

    @classmethod
    def from_extra_config(
        cls, extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
    ) -> ECSettings:
        extra = ExtraConfig(extra_config, LABEL)
        extra.check_known(cls.KNOWN, "GCacheECConnector")
        return cls(
            **cls.store_fields(extra, environ),
            model=extra.name("gcache_model"),
            prefetch_mib=extra.integer("gcache_prefetch_mib", cls.prefetch_mib, 1, 1 << 20),
            wait_ms=extra.number("gcache_wait_ms", cls.wait_ms, 0, 10_000),
            defer_s=extra.number("gcache_defer_s", cls.defer_s, 0, 600),
            save_mib=extra.integer("gcache_save_mib", cls.save_mib, 1, 1 << 20),
            save_queue_jobs_max=extra.integer("gcache_save_queue_jobs_max", cls.save_queue_jobs_max, 1, 1 << 16),
            fetch_queue_jobs_max=extra.integer("gcache_fetch_queue_jobs_max", cls.fetch_queue_jobs_max, 1, 1 << 16),
        )
