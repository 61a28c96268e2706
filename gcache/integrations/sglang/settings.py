"""The GCache backend's settings, read from SGLang's `--hicache-storage-backend-extra-config`.

Every key the backend reads starts with `gcache_`; a misspelled one is an error at
attach time rather than a setting silently ignored. SGLang's own keys
(`backend_name`, `module_path`, `class_name`, `interface_v1`, ...) pass through.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gcache.integrations.common.extra_config import URL_ENV, ExtraConfig, SettingsError
from gcache.integrations.common.store_settings import STORE_KEYS, StoreSettings

__all__ = ["URL_ENV", "BackendSettings", "SettingsError"]


@dataclass(frozen=True)
class BackendSettings(StoreSettings):
    """StoreSettings (url, namespace, timeouts, retries, suspect_s, skip_existing, transport,
    verify_checksums) plus SGLang's own switch."""

    interface_v1: bool = False  # SGLang's zero-copy batch_get_v1 / batch_set_v1 path

    KNOWN = STORE_KEYS

    @classmethod
    def from_extra_config(
        cls, extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
    ) -> BackendSettings:
        extra = ExtraConfig(extra_config, "extra_config")
        extra.check_known(cls.KNOWN, "the GCache backend")
        # SGLang reads interface_v1 as bool(extra_config.get("interface_v1", 0)); so do we.
        return cls(**cls.store_fields(extra, environ), interface_v1=bool(extra.extra.get("interface_v1", 0)))
