"""Reads an engine's `gcache_*` extra-config keys (SGLang's `extra_config`, vLLM's
`kv_connector_extra_config`) with one set of rules and messages: a misspelled key, a number
out of range or a bad address is an error when the engine starts, never a setting silently
ignored."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from gcache.client.connection import parse_address
from gcache.client.transports.choose import TRANSPORTS

URL_ENV = "GCACHE_URL"


class SettingsError(ValueError):
    """The extra config (or GCACHE_URL) cannot configure the adapter; the message says why."""


class ExtraConfig:
    """One engine's extra config; `label` is what the engine calls it, for the messages."""

    def __init__(self, extra: Mapping[str, Any] | None, label: str) -> None:
        self.extra = dict(extra or {})
        self.label = label

    def check_known(self, known: tuple[str, ...], reader: str) -> None:
        unknown = sorted(k for k in self.extra if k.startswith("gcache_") and k not in known)
        if unknown:
            raise SettingsError(f"unknown {self.label} key(s) {unknown}; {reader} reads {list(known)}")

    def number(self, key: str, default: float, lo: float, hi: float, kind: Callable[[float], float] = float) -> float:
        value = self.extra.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not float(value).is_integer())
            or not math.isfinite(value)
            or not lo <= value <= hi
        ):
            raise SettingsError(f"{self.label}[{key!r}] must be a number in [{lo}, {hi}], got {value!r}")
        return kind(value)

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        """number() of an integral value (2.0 is read as 2, 2.5 is refused)."""
        return int(self.number(key, default, lo, hi, int))

    def flag(self, key: str, default: bool) -> bool:
        value = self.extra.get(key, default)
        if not isinstance(value, bool):
            raise SettingsError(f"{self.label}[{key!r}] must be true or false, got {value!r}")
        return value

    def name(self, key: str) -> str | None:
        value = self.extra.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise SettingsError(f"{self.label}[{key!r}] must be a non-empty string, got {value!r}")
        return value

    def url(self, environ: Mapping[str, str] = os.environ) -> str:
        """gcache_url, else GCACHE_URL: "host:port" (one node) or "gcache://master:port,..."."""
        url = self.extra.get("gcache_url") or environ.get(URL_ENV, "")
        if not isinstance(url, str) or not url.strip():
            raise SettingsError(
                f"no GCache address: set {self.label}['gcache_url'] (\"host:port\" or "
                f'"gcache://master:port") or the {URL_ENV} environment variable'
            )
        url = url.strip()
        if not url.startswith("gcache://"):
            try:
                parse_address(url)
            except ValueError as exc:
                raise SettingsError(f"bad GCache address {url!r}: {exc}") from None
        return url

    def transport(self) -> str:
        transport: str = self.extra.get("gcache_transport", "auto")
        if transport not in TRANSPORTS:
            raise SettingsError(
                f"{self.label}['gcache_transport'] must be one of {', '.join(TRANSPORTS)}, got {transport!r}"
            )
        return transport
