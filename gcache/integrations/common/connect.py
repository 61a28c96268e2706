"""An adapter's client: connected and answering when the engine starts, or a clear error."""

from __future__ import annotations

import gcache
from gcache import errors
from gcache.integrations.common.store_settings import StoreSettings


def connect(settings: StoreSettings, who: str) -> gcache.Client:
    """A client that has just reached the store (for a cluster URL: at least one node);
    `who` names the adapter in the error ("GCacheConnector", "GCache backend")."""
    client = None
    try:
        client = gcache.Client(
            settings.url,
            timeout_s=settings.timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            retries=settings.retries,
            transport=settings.transport,
            verify_checksums=settings.verify_checksums,
        )
        answer = client.ping()
    except errors.GCacheError as exc:
        if client is not None:
            client.close()
        raise ConnectionError(
            f"{who}: cannot reach the store at {settings.url}: {exc}. "
            "Start gcache-server (or fix gcache_url / GCACHE_URL)"
        ) from exc
    if settings.url.startswith("gcache://") and not any(isinstance(a, dict) for a in answer.values()):
        client.close()
        raise ConnectionError(
            f"{who}: no node of the cluster at {settings.url} answered: {answer or 'the cluster map lists no nodes'}"
        )
    return client
