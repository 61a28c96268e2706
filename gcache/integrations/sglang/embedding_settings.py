"""The embedding store's settings (no torch, no sglang).

SGLang builds an embedding store with no arguments (`EmbeddingStoreFactory.create_backend(name)`
in its encoder server), so the settings come from the environment: GCACHE_SGLANG_EMBEDDING_CONFIG
holds a JSON object of `gcache_*` keys (or names a JSON file holding one), and GCACHE_URL the
address when the object has none. Every key is checked: a misspelled one is an error when the
encoder starts, never a setting silently ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gcache.integrations.common.extra_config import ExtraConfig, SettingsError
from gcache.integrations.common.store_settings import STORE_KEYS, StoreSettings

__all__ = ["CONFIG_ENV", "EmbeddingSettings", "SettingsError", "read_config"]

CONFIG_ENV = "GCACHE_SGLANG_EMBEDDING_CONFIG"
LABEL = CONFIG_ENV
CONFIG_BYTES_MAX = 1 << 20


def read_config(config: dict[str, Any] | str | None = None, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The settings object: `config` (a dict, or JSON text) when given, else the environment
    variable's JSON (an object, or the path of a file holding one), else {}."""
    if config is None:
        config = environ.get(CONFIG_ENV, "").strip() or None
        if config is not None and not config.startswith("{"):
            path = Path(config)
            try:
                if path.stat().st_size > CONFIG_BYTES_MAX:
                    raise SettingsError(f"{CONFIG_ENV} names {config!r}, over {CONFIG_BYTES_MAX} bytes")
                config = path.read_text()
            except OSError as exc:
                raise SettingsError(
                    f"{CONFIG_ENV} must be a JSON object or the path of a file holding one: {exc}"
                ) from None
    if config is None:
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise SettingsError(f"{LABEL} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SettingsError(f"{LABEL} must be a JSON object of gcache_* keys, got {type(config).__name__}")
    return config


@dataclass(frozen=True)
class EmbeddingSettings(StoreSettings):
    """StoreSettings (url, namespace, timeouts, retries, suspect_s, skip_existing, transport,
    verify_checksums) plus the model identity and the staging bound."""

    model: str | None = None  # gcache_model; None: SGLang's served model name
    staging_mib: int = 64  # bytes staged per call (items split across SGLang page runs)

    KNOWN = (*STORE_KEYS, "gcache_model", "gcache_staging_mib")

    @classmethod
    def from_config(
        cls, config: dict[str, Any] | str | None = None, environ: Mapping[str, str] = os.environ
    ) -> EmbeddingSettings:
        extra = ExtraConfig(read_config(config, environ), LABEL)
        foreign = sorted(k for k in extra.extra if k not in cls.KNOWN)
        if foreign:
            raise SettingsError(f"unknown {LABEL} key(s) {foreign}; the GCache embedding store reads {list(cls.KNOWN)}")
        return cls(
            **cls.store_fields(extra, environ),
            model=extra.name("gcache_model"),
            # kind=int: number() returns an int already; int() tells mypy (it declares float)
            staging_mib=int(extra.number("gcache_staging_mib", cls.staging_mib, 1, 1 << 20, int)),
        )
