"""The connector's L3 events, put together from its settings (gcache_kv_events_*)."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gcache.integrations.vllm.events.publisher import EventPublisher, ZmqSink
from gcache.integrations.vllm.events.source import L3EventSource, SourceLimits, Store

if TYPE_CHECKING:  # the settings are read, never built here: events stay below the connector
    from gcache.integrations.vllm.kv.settings import ConnectorSettings

log = logging.getLogger("gcache.integrations.vllm.events")


def default_topic(settings: ConnectorSettings, model: str) -> str:
    """kv@<pod>@<model>: the topic llm-d's indexer parses (pod and model from the topic)."""
    return settings.kv_events_topic or f"kv@{settings.kv_events_pod or socket.gethostname()}@{model}"


@dataclass
class L3Events:
    publisher: EventPublisher
    source: L3EventSource

    def close(self) -> None:
        self.source.close()
        self.publisher.close()

    def stats(self) -> dict[str, int]:
        return {**self.source.stats, **{f"publish_{k}": v for k, v in self.publisher.stats.items()}}


def l3_events(settings: ConnectorSettings, store: Store, model: str) -> L3Events | None:
    """None when gcache_kv_events_endpoint is unset; an error (at the engine's start) when the
    endpoint cannot be bound."""
    endpoint = settings.kv_events_endpoint
    if endpoint is None:
        return None
    topic = default_topic(settings, model)
    publisher = EventPublisher(topic, lambda: ZmqSink(endpoint), queue_max=settings.kv_events_queue_max)
    limits = SourceLimits(
        pages_max=settings.kv_events_pages_max,
        inbox_max=settings.kv_events_queue_max,
        confirm_s=settings.kv_events_confirm_s,
    )
    source = L3EventSource(store, publisher.publish, limits)
    log.info("GCacheConnector: L3 KV events on %s, topic %r", endpoint, topic)
    return L3Events(publisher, source)
