"""The GCache backend's settings, read from SGLang's `--hicache-storage-backend-extra-config`.

Every key the backend reads starts with `gcache_`; a misspelled one is an error at
attach time rather than a setting silently ignored. SGLang's own keys
(`backend_name`, `module_path`, `class_name`, `interface_v1`, ...) pass through.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from gcache.client.connection import parse_address
from gcache.client.transports.choose import TRANSPORTS

URL_ENV = "GCACHE_URL"


class SettingsError(ValueError):
    """The extra_config (or GCACHE_URL) cannot configure the backend; the message says why."""


def _number(extra: dict, key: str, default: float, lo: float, hi: float, kind=float):
    value = extra.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise SettingsError(f"extra_config[{key!r}] must be a number in [{lo}, {hi}], got {value!r}")
    return kind(value)


@dataclass(frozen=True)
class BackendSettings:
    url: str  # "host:port" (one node) or "gcache://master:port,..." (a cluster)
    namespace: str | None = None  # key prefix, e.g. a tenant: two namespaces never share pages
    timeout_s: float = 2.0  # longest a store call waits without progress
    connect_timeout_s: float = 0.5
    retries: int = 1  # extra attempts on a fresh connection after a failure
    suspect_s: float = 1.0  # after a store failure, calls answer "miss" this long
    skip_existing: bool = True  # writes probe first and send only missing pages
    interface_v1: bool = False  # SGLang's zero-copy batch_get_v1 / batch_set_v1 path
    transport: str = "auto"  # gcache.Client transport: auto, tcp, shm, rdma

    KNOWN = (
        "gcache_url",
        "gcache_namespace",
        "gcache_timeout_s",
        "gcache_connect_timeout_s",
        "gcache_retries",
        "gcache_suspect_s",
        "gcache_skip_existing",
        "gcache_transport",
    )

    @classmethod
    def from_extra_config(cls, extra_config: dict | None, environ=os.environ) -> BackendSettings:
        extra = dict(extra_config or {})
        unknown = sorted(k for k in extra if k.startswith("gcache_") and k not in cls.KNOWN)
        if unknown:
            raise SettingsError(f"unknown extra_config key(s) {unknown}; the GCache backend reads {list(cls.KNOWN)}")
        url = extra.get("gcache_url") or environ.get(URL_ENV, "")
        if not isinstance(url, str) or not url.strip():
            raise SettingsError(
                "no GCache address: set extra_config['gcache_url'] (\"host:port\" or "
                f'"gcache://master:port") or the {URL_ENV} environment variable'
            )
        url = url.strip()
        if not url.startswith("gcache://"):
            try:
                parse_address(url)
            except ValueError as exc:
                raise SettingsError(f"bad GCache address {url!r}: {exc}") from None
        namespace = extra.get("gcache_namespace")
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise SettingsError(f"extra_config['gcache_namespace'] must be a non-empty string, got {namespace!r}")
        transport = extra.get("gcache_transport", "auto")
        if transport not in TRANSPORTS:
            raise SettingsError(
                f"extra_config['gcache_transport'] must be one of {', '.join(TRANSPORTS)}, got {transport!r}"
            )
        skip_existing = extra.get("gcache_skip_existing", True)
        if not isinstance(skip_existing, bool):
            raise SettingsError("extra_config['gcache_skip_existing'] must be true or false")
        return cls(
            url=url,
            namespace=namespace,
            timeout_s=_number(extra, "gcache_timeout_s", cls.timeout_s, 0.01, 600),
            connect_timeout_s=_number(extra, "gcache_connect_timeout_s", cls.connect_timeout_s, 0.01, 600),
            retries=_number(extra, "gcache_retries", cls.retries, 0, 10, int),
            suspect_s=_number(extra, "gcache_suspect_s", cls.suspect_s, 0, 600),
            skip_existing=skip_existing,
            # SGLang reads it as bool(extra_config.get("interface_v1", 0)); so do we.
            interface_v1=bool(extra.get("interface_v1", 0)),
            transport=transport,
        )
