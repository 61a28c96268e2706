"""The encoder cache's scheduler half: which items vLLM takes from the store.

vLLM asks `has_cache_item(identifier)` one item at a time while it schedules, and whatever it
answers True for is never encoded: the worker must then have the embedding before the
forward. So True means "fetched, checksummed and header-checked, here in host memory", never
"probably in the store":

1. `ensure_cache_available(request)` (vLLM calls it before scheduling a request with items):
   the first time, one batched read of all the request's items not yet covered by its cached
   KV goes on a background queue (JobQueue), into buffers of each value's exact size;
2. until that read ends the request is deferred (False), for at most `defer_s`; in a step
   the scheduler waits for reads at most `wait_ms` in all, so a step never waits on the
   network longer than that;
3. the items read whole, with a good checksum and header, are "ready": `has_cache_item`
   answers True for them, `update_state_after_alloc` hands their bytes to this step's
   metadata, and the worker puts them into vLLM's encoder cache. Everything else (a miss, a
   bad checksum, a dead store, a full queue, a timeout) is False: vLLM runs the encoder.

A producer-only engine (ec_producer) asks the store whether items exist (one batch per
request) instead, and skips encoding the ones that do.

Items vLLM encodes are named in the metadata with their keys (`saves`) so that a producer's
worker writes them. Everything held is bounded: ready bytes by `prefetch_bytes`, requests
and known items by counts, queued reads by the queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from gcache.integrations.common.job_queue import JobQueue
from gcache.integrations.vllm.ec.keys import ItemKeys, ItemSpec
from gcache.integrations.vllm.ec.value import Header, check_value, value_bytes

if TYPE_CHECKING:  # vLLM's types: Any to the type check (not installed in .venv)
    from vllm.v1.request import Request

    from gcache.integrations.common.guarded_store import GuardedStore
    from gcache.integrations.vllm.ec.settings import ECSettings
    from gcache.integrations.vllm.ec.stats import ECStats

log = logging.getLogger("gcache.integrations.vllm.ec")

REQUESTS_MAX = 8192  # requests whose lookup state is kept (oldest forgotten first)
KNOWN_MAX = 65536  # items whose existence a producer-only engine remembers


class Loaded(NamedTuple):
    """One fetched value: the whole value (header + payload) and its header."""

    value: np.ndarray
    header: Header


class _Ready:
    __slots__ = ("loaded", "holders")

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.holders: set[str] = set()  # ids of the requests holding it


class _Lookup:
    """One request's batched read (or existence check)."""

    __slots__ = (
        "req_id",
        "specs",
        "identifiers",
        "buffers",
        "done",
        "abandoned",
        "absorbed",
        "results",
        "deadline",
        "held",
    )

    def __init__(self, req_id: str, specs: list[ItemSpec], identifiers: list[str], deadline: float):
        self.req_id = req_id
        self.specs = specs  # ItemSpec per item
        self.identifiers = identifiers
        self.buffers: list[np.ndarray] = []
        self.done = threading.Event()
        self.abandoned = False  # the request stopped waiting (or finished): results are dropped
        self.absorbed = False
        self.results: dict[str, Loaded | bool] = {}  # identifier -> Loaded (reads) or bool (existence)
        self.deadline = deadline
        self.held: set[str] = set()  # identifiers of ready items this request holds


class ECSchedulerSide:
    def __init__(
        self,
        settings: ECSettings,
        keys: ItemKeys,
        store: GuardedStore,
        stats: ECStats,
        load: bool,
        save: bool,
        clock: Callable[[], float] = time.monotonic,  # deadlines (defer_s); a step's wait is measured in real time
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.store = store
        self.stats = stats
        self.load = load  # ec_consumer / ec_both: items are read and handed to the worker
        self.save = save  # ec_producer / ec_both: encoded items are named for the worker to write
        self.clock = clock
        self._lock = threading.Lock()  # guards _held_bytes and each lookup's finish/abandon
        self._held_bytes = 0  # buffers of reads in flight plus ready values
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()
        self._ready: dict[str, _Ready] = {}
        self._known: OrderedDict[str, bool] = OrderedDict()
        self._yes: set[str] = set()  # identifiers answered True in this step
        self._loads: dict[str, Loaded] = {}  # identifier -> Loaded, this step
        self._saves: dict[str, ItemSpec] = {}  # identifier -> ItemSpec, this step
        self._wait_left = settings.wait_ms / 1000.0
        self._jobs = JobQueue("gcache-ec-fetch", self._run, settings.fetch_queue_jobs_max, log)

    # -- vLLM's hooks -----------------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """False while the request's read is in flight (vLLM defers it), else True."""
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            lookup = self._start(request, num_computed_tokens)
            if lookup is None:
                return True
        if lookup.absorbed:
            return True
        if lookup.done.is_set():
            self._absorb(lookup)
            return True
        if self.clock() >= lookup.deadline:
            self.stats.count("defer_timeouts")
            if not self._abandon(lookup):  # finished meanwhile
                self._absorb(lookup)
            lookup.absorbed = True
            return True
        if self._wait_left > 0:
            t0 = time.monotonic()
            lookup.done.wait(self._wait_left)
            self._wait_left = max(0.0, self._wait_left - (time.monotonic() - t0))
            if lookup.done.is_set():
                self._absorb(lookup)
                return True
        self.stats.count("deferred_steps")
        return False

    def has_cache_item(self, identifier: str) -> bool:
        found = identifier in self._ready if self.load else self._known.get(identifier, False)
        if found:
            self._yes.add(identifier)
        return found

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        identifier = feature.identifier
        if identifier in self._yes:
            if not self.load:
                return  # a producer-only engine skips an item the store has
            ready = self._ready.get(identifier)
            if ready is None:  # cannot happen: nothing drops ready items between the two calls
                log.error("GCacheECConnector: item %s answered found but not held", identifier)
                return
            self._loads[identifier] = ready.loaded
            self.stats.count("items_load_planned")
            ready.holders.discard(request.request_id)
            if not ready.holders:
                self._drop_ready(identifier)
        elif self.save:
            self._saves[identifier] = self.keys.spec(identifier, feature.modality, feature.mm_position.get_num_embeds())

    def build_step(
        self, scheduled_encoder_inputs: dict[str, list[int]]
    ) -> tuple[dict[str, Loaded], dict[str, ItemSpec]]:
        """This step's (loads, saves) for the metadata; resets the step's state."""
        loads, saves = self._loads, self._saves
        self._loads, self._saves = {}, {}
        self._yes.clear()
        self._wait_left = self.settings.wait_ms / 1000.0
        encoded = sum(len(ids) for ids in scheduled_encoder_inputs.values())
        if encoded:
            self.stats.count("items_encoded", encoded)
        return loads, saves

    def request_finished(self, request: Request) -> None:
        self._forget(request.request_id)

    def close(self, timeout_s: float = 5.0) -> None:
        for lookup in list(self._lookups.values()):
            self._abandon(lookup)
        self._jobs.close(timeout_s)

    # -- reads --------------------------------------------------------------------------------

    def _start(self, request: Request, num_computed_tokens: int) -> _Lookup | None:
        req_id = request.request_id
        specs, identifiers, held = [], [], set()
        for feature in request.mm_features or ():
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # its tokens' KV is cached: vLLM will not need its embedding
            identifier = feature.identifier
            if identifier in identifiers:
                continue
            if self.load and identifier in self._ready:
                self._ready[identifier].holders.add(req_id)
                held.add(identifier)
                continue
            if not self.load and identifier in self._known:
                self._known.move_to_end(identifier)
                continue
            try:
                spec = self.keys.spec(identifier, feature.modality, pos.get_num_embeds())
            except ValueError as exc:  # a key over the limit: this item is encoded
                log.warning("GCacheECConnector: %s", exc)
                continue
            specs.append(spec)
            identifiers.append(identifier)
        lookup = _Lookup(req_id, specs, identifiers, self.clock() + self.settings.defer_s)
        lookup.held = held
        self._remember(lookup)
        if not specs:
            lookup.absorbed = True
            return lookup
        if self.load:
            self._reserve(lookup)
            if not lookup.specs:
                lookup.absorbed = True
                return lookup
        self.stats.count("requests_looked_up")
        self.stats.count("items_looked_up", len(lookup.specs))
        if not self._jobs.submit(lookup):
            self.stats.count("fetches_refused")
            self._release(sum(b.nbytes for b in lookup.buffers))
            lookup.buffers = []
            lookup.absorbed = True
        return lookup

    def _reserve(self, lookup: _Lookup) -> None:
        """Buffers for the items that fit in prefetch_bytes; the others are encoded."""
        keep_specs, keep_ids = [], []
        for spec, identifier in zip(lookup.specs, lookup.identifiers):
            nbytes = value_bytes(spec.dtype, (spec.rows, spec.width))
            with self._lock:
                fits = self._held_bytes + nbytes <= self.settings.prefetch_bytes
                if fits:
                    self._held_bytes += nbytes
            if not fits:
                self.stats.count("items_over_budget")
                continue
            keep_specs.append(spec)
            keep_ids.append(identifier)
            lookup.buffers.append(np.empty(nbytes, dtype=np.uint8))
        lookup.specs, lookup.identifiers = keep_specs, keep_ids

    def _run(self, lookup: _Lookup) -> None:
        """On the queue's thread: one batched store call for the request's items."""
        t0 = time.perf_counter()
        keys = [s.key for s in lookup.specs]
        results: dict[str, Loaded | bool] = {}
        release = 0
        if self.load:
            lengths = self.store.get_into(keys, lookup.buffers, [b.nbytes for b in lookup.buffers])
            for spec, identifier, buf, length in zip(lookup.specs, lookup.identifiers, lookup.buffers, lengths):
                header = check_value(buf, length, spec.dtype, spec.width, spec.rows)
                if header is not None and length is not None:
                    results[identifier] = Loaded(buf, header)
                    self.stats.count("items_found")
                    self.stats.count("bytes_fetched", int(length))
                else:
                    self.stats.count("items_missing" if length is None else "items_bad")
                    release += buf.nbytes
        else:
            for identifier, there in zip(lookup.identifiers, self.store.exists_flags(keys)):
                results[identifier] = bool(there)
                self.stats.count("items_found" if there else "items_missing")
        self.stats.count("fetch_s", time.perf_counter() - t0)
        with self._lock:
            if lookup.abandoned:
                release += sum(loaded.value.nbytes for loaded in results.values() if isinstance(loaded, Loaded))
                results = {}
            lookup.results = results
            lookup.buffers = []
            self._held_bytes -= release
            lookup.done.set()

    def _abandon(self, lookup: _Lookup) -> bool:
        """Stops waiting for a read; False when it had finished (its results stand)."""
        with self._lock:
            if lookup.done.is_set():
                return False
            lookup.abandoned = True
            return True

    def _absorb(self, lookup: _Lookup) -> None:
        """Makes a finished read's items ready (or known) to this request."""
        if lookup.absorbed:
            return
        lookup.absorbed = True
        if lookup.req_id not in self._lookups:  # forgotten meanwhile: release what it read
            self._release(sum(r.value.nbytes for r in lookup.results.values() if isinstance(r, Loaded)))
            return
        for identifier, result in lookup.results.items():
            if isinstance(result, Loaded):  # a read (self.load); else an existence check
                ready = self._ready.get(identifier)
                if ready is None:
                    ready = self._ready[identifier] = _Ready(result)
                else:  # another request's read brought it first
                    self._release(result.value.nbytes)
                ready.holders.add(lookup.req_id)
                lookup.held.add(identifier)
            else:
                self._known[identifier] = result
                self._known.move_to_end(identifier)
                while len(self._known) > KNOWN_MAX:
                    self._known.popitem(last=False)
        lookup.results = {}

    # -- what is held ----------------------------------------------------------------------------

    def _remember(self, lookup: _Lookup) -> None:
        self._lookups[lookup.req_id] = lookup
        while len(self._lookups) > REQUESTS_MAX:
            oldest = next(iter(self._lookups))
            self._forget(oldest)

    def _forget(self, req_id: str) -> None:
        lookup = self._lookups.pop(req_id, None)
        if lookup is None:
            return
        if not lookup.absorbed and not self._abandon(lookup):
            self._absorb(lookup)  # finished, not absorbed: releases (no longer remembered)
        for identifier in lookup.held:
            ready = self._ready.get(identifier)
            if ready is not None and req_id in ready.holders:
                ready.holders.discard(req_id)
                if not ready.holders:
                    self._drop_ready(identifier)

    def _drop_ready(self, identifier: str) -> None:
        ready = self._ready.pop(identifier, None)
        if ready is not None:
            self._release(ready.loaded.value.nbytes)

    def _release(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self._held_bytes -= nbytes

    # -- for tests and reports ------------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes

    def wait_idle(self, timeout_s: float) -> bool:
        return self._jobs.wait_idle(timeout_s)

    def sizes(self) -> dict[str, int]:
        return dict(lookups=len(self._lookups), ready=len(self._ready), known=len(self._known))
