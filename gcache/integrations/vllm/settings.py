"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

Every key the connector reads starts with `gcache_`; a misspelled one is an error when the
engine starts rather than a setting silently ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gcache.integrations.common.extra_config import URL_ENV, ExtraConfig, SettingsError

__all__ = ["URL_ENV", "ConnectorSettings", "SettingsError"]


@dataclass(frozen=True)
class ConnectorSettings:
    url: str  # "host:port" (one node) or "gcache://master:port,..." (a cluster)
    namespace: str | None = None  # key prefix (a tenant): two namespaces never share pages
    model: str | None = None  # the model's name in keys (default: vLLM's served model name)
    timeout_s: float = 2.0  # longest a store call waits without progress
    connect_timeout_s: float = 0.5
    retries: int = 1
    suspect_s: float = 5.0  # after a store failure, calls answer "miss" this long
    transport: str = "auto"
    verify_checksums: bool = True  # a page whose bytes fail their xxh64 is a failed load
    checkpoint_pages: int = 16  # C: sliding-window KV is kept at every C pages (and prompt ends)
    swa_every_page: bool = False  # store every sliding-window page (the benchmark's baseline)
    save_queue_jobs_max: int = 256  # save jobs (one per layer and step) waiting; beyond: dropped
    load_queue_jobs_max: int = 256  # async loads waiting
    async_load_min_tokens: int = 512  # hits this long load between steps; shorter ones in the step
    skip_existing: bool = True  # saves probe first and send only missing pages

    KNOWN = (
        "gcache_url",
        "gcache_namespace",
        "gcache_model",
        "gcache_timeout_s",
        "gcache_connect_timeout_s",
        "gcache_retries",
        "gcache_suspect_s",
        "gcache_transport",
        "gcache_verify_checksums",
        "gcache_checkpoint_pages",
        "gcache_swa_every_page",
        "gcache_save_queue_jobs_max",
        "gcache_load_queue_jobs_max",
        "gcache_async_load_min_tokens",
        "gcache_skip_existing",
    )

    @classmethod
    def from_extra_config(cls, extra_config: dict | None, environ=os.environ) -> ConnectorSettings:
        extra = ExtraConfig(extra_config, "kv_connector_extra_config")
        extra.check_known(cls.KNOWN, "GCacheConnector")
        return cls(
            url=extra.url(environ),
            namespace=extra.name("gcache_namespace"),
            model=extra.name("gcache_model"),
            timeout_s=extra.number("gcache_timeout_s", cls.timeout_s, 0.01, 600),
            connect_timeout_s=extra.number("gcache_connect_timeout_s", cls.connect_timeout_s, 0.01, 600),
            retries=extra.number("gcache_retries", cls.retries, 0, 10, int),
            suspect_s=extra.number("gcache_suspect_s", cls.suspect_s, 0, 600),
            transport=extra.transport(),
            verify_checksums=extra.flag("gcache_verify_checksums", cls.verify_checksums),
            checkpoint_pages=extra.number("gcache_checkpoint_pages", cls.checkpoint_pages, 1, 1 << 20, int),
            swa_every_page=extra.flag("gcache_swa_every_page", cls.swa_every_page),
            save_queue_jobs_max=extra.number("gcache_save_queue_jobs_max", cls.save_queue_jobs_max, 1, 1 << 16, int),
            load_queue_jobs_max=extra.number("gcache_load_queue_jobs_max", cls.load_queue_jobs_max, 1, 1 << 16, int),
            async_load_min_tokens=extra.number(
                "gcache_async_load_min_tokens", cls.async_load_min_tokens, 0, 1 << 30, int
            ),
            skip_existing=extra.flag("gcache_skip_existing", cls.skip_existing),
        )
