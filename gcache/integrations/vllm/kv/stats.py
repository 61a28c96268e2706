"""What the connector counts: hits, values and bytes moved, seconds spent, drops, store errors.

Thread-safe counters, always on. `counters()` on the connector returns them; vLLM's
`get_kv_connector_stats` gets the change since its last call.
"""

from __future__ import annotations

from gcache.integrations.common.counters import Counters

COUNTERS = (
    "lookups",  # get_num_new_matched_tokens calls that asked the store
    "hit_tokens",  # external tokens reported to vLLM
    "values_loaded",  # (page, group) values read whole and copied into vLLM's blocks
    "bytes_loaded",
    "load_failed_values",  # values missing, short or corrupt: their blocks are recomputed
    "load_values_no_staging",  # values not loaded: no free load slots
    "values_loaded_direct",  # of values_loaded: straight from the store's shared memory into the blocks
    "loads_refused_queue_full",
    "loads_async",
    "loads_sync",
    "save_values_offered",  # values of the pages a step completed: saved, skipped, failed or dropped
    "values_saved",  # (page, group) values written
    "bytes_saved",
    "values_skipped_existing",
    "values_save_failed",
    "save_pages_dropped",  # the put queue was full
    "save_pages_dropped_staging",  # no free save slots
    "save_pages_dropped_load_failed",  # computed in a step whose synchronous load failed (issue 37)
    "save_values_dropped",  # the values of the pages dropped (any of the three reasons)
    "swa_values_saved",
    "state_values_offered",  # boundary states vLLM offered that the scheduler planned to save
    "state_values_queued",  # ...that the worker queued for the store
    "state_values_over_bound",  # offered past a request's gcache_state_boundaries_max: not saved
    "store_errors",
    "calls_while_suspect",
    "corrupt_values_removed",  # values that failed their checksum, removed from the store
    # Prefetch (prefetch.py): started when a request arrives, read into staging.
    "prefetches",
    "prefetch_refused",  # no room (staging or prefetches in flight): looked up when asked instead
    "prefetch_cancelled",  # the request finished, was aborted, or its hit was smaller
    "prefetch_timeouts",  # the store took longer than gcache_prefetch_wait_s: recomputed
    "prefetch_behind",  # vLLM lost pages it held at arrival: those were never read; looked up instead
    "prefetch_pages_staged",
    "prefetch_bytes_staged",
    "loads_staged",  # loads copied from prefetch staging (no store call in the step)
    "staged_values_loaded",
    "staged_bytes_loaded",
    # The async tax: a load between steps parks its request in WAITING_FOR_REMOTE_KVS...
    "remote_waits",  # requests that left it (scheduled after their load)
    "remote_waits_one_step",  # of those, the ones that waited at most 1 engine step (the median's goal)
    "remote_wait_steps",  # engine steps they spent there, summed
    # ...and a load in the step makes the others' step longer: steps that ran other requests,
    # with a load in the step or in flight, and without.
    "steps_loading",
    "steps_plain",
    "requests_preempted",  # vLLM preempted them (their blocks were freed; resumed later)
)
SECONDS = (
    "load_s",
    "save_s",
    "lookup_s",
    "prefetch_s",
    "staged_load_s",
    "remote_wait_s",  # time in WAITING_FOR_REMOTE_KVS, summed over remote_waits
    "step_loading_s",  # summed over steps_loading
    "step_plain_s",  # summed over steps_plain
)


class ConnectorStats(Counters):
    def __init__(self) -> None:
        super().__init__(COUNTERS, SECONDS)
