"""The settings every engine adapter has: where the store is and how calls to it behave.

`StoreSettings` is the base of each adapter's settings dataclass (SGLang's BackendSettings,
vLLM's ConnectorSettings); an adapter adds its own fields and may change a default by
redeclaring the field. `store_fields` reads these keys from an engine's extra config with the
subclass's defaults, so the eight keys have one reader and one set of limits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gcache.integrations.common.extra_config import ExtraConfig

STORE_KEYS = (
    "gcache_url",
    "gcache_namespace",
    "gcache_timeout_s",
    "gcache_connect_timeout_s",
    "gcache_retries",
    "gcache_suspect_s",
    "gcache_skip_existing",
    "gcache_transport",
    "gcache_verify_checksums",
)


@dataclass(frozen=True)
class StoreSettings:
    url: str  # "host:port" (one node) or "gcache://master:port,..." (a cluster)
    namespace: str | None = None  # key prefix (a tenant): two namespaces never share pages
    timeout_s: float = 2.0  # longest a store call waits without progress
    connect_timeout_s: float = 0.5
    retries: int = 1  # extra attempts on a fresh connection after a failure
    suspect_s: float = 1.0  # after a store failure, calls answer "miss" this long
    skip_existing: bool = True  # writes probe first and send only missing pages
    transport: str = "auto"  # gcache.Client transport: auto, tcp, shm, rdma
    verify_checksums: bool = True  # a value whose bytes fail their checksum is a miss

    @classmethod
    def store_fields(cls, extra: ExtraConfig, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
        """The StoreSettings fields read from `extra`, with this class's defaults."""
        return dict(
            url=extra.url(environ),
            namespace=extra.name("gcache_namespace"),
            timeout_s=extra.number("gcache_timeout_s", cls.timeout_s, 0.01, 600),
            connect_timeout_s=extra.number("gcache_connect_timeout_s", cls.connect_timeout_s, 0.01, 600),
            retries=extra.number("gcache_retries", cls.retries, 0, 10, int),
            suspect_s=extra.number("gcache_suspect_s", cls.suspect_s, 0, 600),
            skip_existing=extra.flag("gcache_skip_existing", cls.skip_existing),
            transport=extra.transport(),
            verify_checksums=extra.flag("gcache_verify_checksums", cls.verify_checksums),
        )
