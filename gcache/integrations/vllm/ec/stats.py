"""What the encoder cache counts (thread-safe, always on). `counters()` on the connector
returns them; vLLM's `get_ec_connector_stats` gets the change since its last call."""

from __future__ import annotations

from gcache.integrations.common.counters import Counters

COUNTERS = (
    # scheduler side
    "requests_looked_up",  # requests whose items were asked of the store (one batch each)
    "items_looked_up",
    "items_found",  # fetched whole, checksum and header good: the encoder will not run for them
    "items_missing",  # not in the store, or failed its checksum (then corrupt_values_removed too)
    "items_bad",  # read, but of another size, dtype or shape than vLLM expects
    "items_over_budget",  # not fetched: gcache_prefetch_mib was full
    "bytes_fetched",
    "fetches_refused",  # the fetch queue was full: the request's items are encoded
    "deferred_steps",  # steps a request waited for its fetch
    "defer_timeouts",  # requests that stopped waiting (gcache_defer_s): their items are encoded
    "items_load_planned",  # items vLLM took from the connector instead of its encoder
    "items_encoded",  # items vLLM scheduled on its encoder (its own decision, from its output)
    # worker side
    "encoder_outputs",  # encoder outputs vLLM's model runner produced (one per item encoded)
    "items_loaded",  # embeddings put into vLLM's encoder cache
    "bytes_loaded",
    "items_saved",
    "bytes_saved",
    "saves_skipped_existing",
    "saves_failed",
    "saves_dropped",  # the save queue or gcache_save_mib was full
    "saves_mismatch",  # an encoder output not of the planned dtype / shape: not saved
    # the store
    "store_errors",
    "calls_while_suspect",
    "corrupt_values_removed",
)
SECONDS = ("fetch_s", "save_s", "load_s")


class ECStats(Counters):
    def __init__(self) -> None:
        super().__init__(COUNTERS, SECONDS)
