"""The GCache backend's settings, read from SGLang's `--hicache-storage-backend-extra-config`.

Every key the backend reads starts with `gcache_`; a misspelled one is an error at
attach time rather than a setting silently ignored. SGLang's own keys
(`backend_name`, `module_path`, `class_name`, `interface_v1`, ...) pass through.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gcache.integrations.common.extra_config import URL_ENV, ExtraConfig, SettingsError

__all__ = ["URL_ENV", "BackendSettings", "SettingsError"]


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
        extra = ExtraConfig(extra_config, "extra_config")
        extra.check_known(cls.KNOWN, "the GCache backend")
        return cls(
            url=extra.url(environ),
            namespace=extra.name("gcache_namespace"),
            timeout_s=extra.number("gcache_timeout_s", cls.timeout_s, 0.01, 600),
            connect_timeout_s=extra.number("gcache_connect_timeout_s", cls.connect_timeout_s, 0.01, 600),
            retries=extra.number("gcache_retries", cls.retries, 0, 10, int),
            suspect_s=extra.number("gcache_suspect_s", cls.suspect_s, 0, 600),
            skip_existing=extra.flag("gcache_skip_existing", cls.skip_existing),
            # SGLang reads it as bool(extra_config.get("interface_v1", 0)); so do we.
            interface_v1=bool(extra.extra.get("interface_v1", 0)),
            transport=extra.transport(),
        )
