"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

Every key the connector reads starts with `gcache_`; a misspelled one is an error when the
engine starts rather than a setting silently ignored.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from gcache.client.connection import parse_address
from gcache.client.transports.choose import TRANSPORTS

URL_ENV = "GCACHE_URL"


class SettingsError(ValueError):
    """The extra_config (or GCACHE_URL) cannot configure the connector; the message says why."""


def _number(extra: dict, key: str, default, lo, hi, kind=float):
    value = extra.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise SettingsError(f"kv_connector_extra_config[{key!r}] must be a number in [{lo}, {hi}], got {value!r}")
    return kind(value)


def _flag(extra: dict, key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise SettingsError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value


def _name(extra: dict, key: str) -> str | None:
    value = extra.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise SettingsError(f"kv_connector_extra_config[{key!r}] must be a non-empty string, got {value!r}")
    return value


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
        extra = dict(extra_config or {})
        unknown = sorted(k for k in extra if k.startswith("gcache_") and k not in cls.KNOWN)
        if unknown:
            raise SettingsError(
                f"unknown kv_connector_extra_config key(s) {unknown}; GCacheConnector reads {list(cls.KNOWN)}"
            )
        url = extra.get("gcache_url") or environ.get(URL_ENV, "")
        if not isinstance(url, str) or not url.strip():
            raise SettingsError(
                "no GCache address: set kv_connector_extra_config['gcache_url'] (\"host:port\" or "
                f'"gcache://master:port") or the {URL_ENV} environment variable'
            )
        url = url.strip()
        if not url.startswith("gcache://"):
            try:
                parse_address(url)
            except ValueError as exc:
                raise SettingsError(f"bad GCache address {url!r}: {exc}") from None
        transport = extra.get("gcache_transport", "auto")
        if transport not in TRANSPORTS:
            raise SettingsError(
                f"kv_connector_extra_config['gcache_transport'] must be one of {', '.join(TRANSPORTS)}, "
                f"got {transport!r}"
            )
        return cls(
            url=url,
            namespace=_name(extra, "gcache_namespace"),
            model=_name(extra, "gcache_model"),
            timeout_s=_number(extra, "gcache_timeout_s", cls.timeout_s, 0.01, 600),
            connect_timeout_s=_number(extra, "gcache_connect_timeout_s", cls.connect_timeout_s, 0.01, 600),
            retries=_number(extra, "gcache_retries", cls.retries, 0, 10, int),
            suspect_s=_number(extra, "gcache_suspect_s", cls.suspect_s, 0, 600),
            transport=transport,
            verify_checksums=_flag(extra, "gcache_verify_checksums", cls.verify_checksums),
            checkpoint_pages=_number(extra, "gcache_checkpoint_pages", cls.checkpoint_pages, 1, 1 << 20, int),
            swa_every_page=_flag(extra, "gcache_swa_every_page", cls.swa_every_page),
            save_queue_jobs_max=_number(extra, "gcache_save_queue_jobs_max", cls.save_queue_jobs_max, 1, 1 << 16, int),
            load_queue_jobs_max=_number(extra, "gcache_load_queue_jobs_max", cls.load_queue_jobs_max, 1, 1 << 16, int),
            async_load_min_tokens=_number(
                extra, "gcache_async_load_min_tokens", cls.async_load_min_tokens, 0, 1 << 30, int
            ),
            skip_existing=_flag(extra, "gcache_skip_existing", cls.skip_existing),
        )
