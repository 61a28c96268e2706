"""Rebalance: move the keys this node no longer owns to their owners (docs/cluster.md).

For a map M, every local key whose write-ring owner is another node is read
from this node's own data port and PUT to that owner with `epoch=M.epoch` (an
owner with a newer map refuses it: the rebalance stops, a newer map is on its
way). Pushed keys are then removed here, unless this node is draining or has
left the map (it keeps serving fallback reads until it exits). In drop mode
(when a registration (re)added this node to the map) such keys are removed
without being pushed: they may have been removed or replaced while it was away.

Reading without per-value copies: values go straight from the socket into a
reusable bytearray with `batch_get_into`, and from there to the owner's socket
with `batch_put_from`.

Overlap: up to OWNER_LANES owners are pushed to at once (an owner stores one
frame at a time, so a drain to several owners is otherwise paced by one of them
at a time), each in its own lane: two buffers that take turns, a reader thread
filling one with the next batch while the other is pushed, so the local read
and the push overlap too. A buffer is refilled only once its push returned.
Every buffer holds batch_bytes / OWNER_LANES (or the largest value), so all
lanes together hold at most 2 x batch_bytes.

Value sizes are not known in advance, so every key of a batch gets a slot of
`slot_bytes`, the largest value size seen so far (a first probe batch of
PROBE_KEYS keys uses big slots to learn it). A value larger than its slot is not
read (BufferTooSmallError names it and its size): the slot grows and the key
goes back into the queue. KV-cache values are mostly one
size, so slots waste little and each batch is one GET and one PUT frame train.

A run that repeats an incomplete one (same map: some owner was unreachable)
first asks each owner which of its keys it already has (`batch_is_exist`, no
values sent) and skips those, so a draining node does not push them again.

Listing: keys come page by page from the native store (`keys_page`, the store
lock held per page only); unowned keys gather up to `keys_pending_max` and are
moved, then the scan goes on from its cursor, so memory stays bounded whatever
the key count. Before the first page the rebalancer waits (`fence`) until no
PUT frame the node admitted under an older map is still storing: such a value
could otherwise land in a part of the index already listed and never move. If
that wait times out (a peer trickling a huge frame), the scan runs anyway and
once more at the end.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue as queue_module
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

from gcache import errors
from gcache.cluster.cluster_map import DEAD, DRAINING, ClusterMap
from gcache.cluster.placement import Placement

log = logging.getLogger("gcache.server.rebalance")

KEYS_PAGE = 65_536  # keys per keys_page call (the native cap)
KEYS_PENDING_MAX = 262_144  # unowned keys gathered before moving them (Python bytes: ~100 B each)
FENCE_TIMEOUT_S = 10.0  # wait for PUTs admitted under an older map; a trickler is not waited out
FENCE_SLICE_S = 0.5  # ... in slices, so a newer map aborts the wait
BATCH_KEYS_MAX = 4096
PROBE_KEYS = 16
OWNER_LANES = 3  # owners pushed to at once, each with two buffers of batch_bytes / OWNER_LANES
PUSH_ATTEMPTS = 3  # per batch, on top of the client's own retries
PUSH_BACKOFF_S = 0.2
CLIENT_TIMEOUT_S = 5.0  # per socket wait; a stopped owner costs PUSH_ATTEMPTS of these


class RebalanceAborted(Exception):
    """A newer map arrived (or the node is stopping): start over with that one."""


@dataclass
class RebalanceCounters:
    """Totals since the process started; /metrics and GET /cluster show them."""

    rebalances: int = 0
    rebalances_aborted: int = 0
    keys_pushed: int = 0
    bytes_pushed: int = 0
    keys_dropped: int = 0
    push_failures: int = 0  # keys not pushed: owner unreachable (retried) or value too large
    push_no_space: int = 0  # keys an owner refused NO_SPACE (kept here)
    seconds: float = 0.0
    last_epoch: int = 0
    last_mb_per_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass
class RebalanceResult:
    epoch: int
    mode: str  # "push" or "drop"
    keys_seen: int = 0
    keys_unowned: int = 0
    keys_pushed: int = 0
    bytes_pushed: int = 0
    keys_dropped: int = 0
    push_failures: int = 0
    push_unreachable: int = 0  # of push_failures: the owner could not be reached
    push_no_space: int = 0
    keys_present: int = 0  # skipped on a repeated run: the owner already had them
    owners: int = 0
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every unowned key was pushed, or refused by its owner as not fitting (no space,
        too large): retrying cannot do better. Unreachable owners make it incomplete."""
        return self.push_unreachable == 0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_pushed / 1e6 / self.seconds if self.seconds > 0 else 0.0


def keeps_local_copies(cmap: ClusterMap, node_id: str) -> bool:
    """A draining node (or one that already left the map) keeps serving what it pushed."""
    me = cmap.node(node_id)
    return me is None or me.state in (DRAINING, DEAD)


class Rebalancer:
    """Moves one node's unowned keys for one map at a time (not thread-safe: one caller)."""

    def __init__(
        self,
        node_id: str,
        local_address: str,
        *,
        list_keys_page: Callable[[int, int], tuple[int, list]],
        remove_keys: Callable[[list], object] | None = None,
        fence: Callable[[int, float], bool] | None = None,
        batch_bytes: int = 64 << 20,
        batch_keys: int = BATCH_KEYS_MAX,
        counters: RebalanceCounters | None = None,
        keys_pending_max: int = KEYS_PENDING_MAX,
        keys_page: int = KEYS_PAGE,
        fence_timeout_s: float = FENCE_TIMEOUT_S,
        token: str | None = None,
        placement_key: Callable[[bytes], bytes] | None = None,
    ):
        """list_keys_page(cursor, limit) -> (next cursor, keys): a scan that starts at cursor 0
        and ends when the next cursor is 0 (Server.keys_page). fence(epoch, timeout_s) -> bool:
        True once no PUT admitted below `epoch` is still storing (Server.wait_puts_admitted_before);
        None skips the wait. token: the cluster role's token on a node with --auth-file (its
        keys are then tenant-prefixed: placement_key gives the key clients hash)."""
        from gcache.client import Client  # late: the server imports this module at start

        self.node_id = node_id
        self.batch_bytes = batch_bytes
        self.lane_batch_bytes = max(1, batch_bytes // OWNER_LANES)
        self.batch_keys = max(1, min(batch_keys, BATCH_KEYS_MAX))
        self.counters = counters or RebalanceCounters()
        self.keys_pending_max = max(1, keys_pending_max)
        self.keys_page = max(1, min(keys_page, KEYS_PAGE))
        self.fence_timeout_s = fence_timeout_s
        self._list_keys_page = list_keys_page
        self._remove_keys = remove_keys
        self._fence = fence
        self._client_class = Client
        self._token = token
        self._placement_key = placement_key
        # Each lane reads (its reader thread) and removes (its pusher thread) at once.
        # Client.__new__ returns the implementation for the address (gcache.client.factory);
        # mypy checks the abstract contract's constructor instead
        self._local = Client(  # type: ignore[abstract, call-arg]
            local_address, timeout_s=CLIENT_TIMEOUT_S, pool_size=2 * OWNER_LANES, token=token
        )
        self._lanes = [_Lane() for _ in range(OWNER_LANES)]  # kept: no page faults per run
        self._slot_bytes = 0  # largest value seen; 0 = unknown yet
        self._slot_lock = threading.Lock()
        self._result_lock = threading.Lock()
        self._incomplete_epoch: int | None = None  # the last run's map, if it left keys unpushed

    def close(self) -> None:
        self._local.close()

    # -- one map --------------------------------------------------------------

    def run(
        self, cmap: ClusterMap, *, drop: bool = False, should_abort: Callable[[], bool] = lambda: False
    ) -> RebalanceResult:
        """Rebalances for `cmap`; raises RebalanceAborted if should_abort() turns true."""
        result = RebalanceResult(cmap.epoch, "drop" if drop else "push")
        start = time.monotonic()
        scan = _Scan(
            cmap,
            Placement(cmap),
            drop,
            keeps_local_copies(cmap, self.node_id),
            result,
            should_abort,
            repeat=cmap.epoch == self._incomplete_epoch,
            pushers=ThreadPoolExecutor(OWNER_LANES, thread_name_prefix="gcache-rebalance-push"),
            readers=ThreadPoolExecutor(OWNER_LANES, thread_name_prefix="gcache-rebalance-read"),
        )
        for lane in self._lanes:
            scan.free_lanes.put(lane)
        self._incomplete_epoch = cmap.epoch  # until this run completes
        try:
            fenced = self._wait_for_old_puts(cmap.epoch, should_abort)
            self._scan(scan)
            if not fenced:
                # A PUT admitted under the older map may have stored its key where the
                # scan had already been: look once more, after waiting again.
                if not self._wait_for_old_puts(cmap.epoch, should_abort):
                    log.warning(
                        "epoch %d: PUTs admitted under an older map are still arriving; "
                        "their keys may stay here until the next map",
                        cmap.epoch,
                    )
                self._scan(scan)
        except RebalanceAborted:
            self.counters.add(rebalances_aborted=1)
            raise
        finally:
            scan.stop.set()
            scan.pushers.shutdown(wait=True, cancel_futures=True)
            scan.readers.shutdown(wait=True, cancel_futures=True)  # no read still writes a buffer
            for client in scan.clients.values():
                client.close()
            result.owners = len(scan.clients)
            result.seconds = time.monotonic() - start
            self.counters.add(seconds=result.seconds)
        if result.complete:
            self._incomplete_epoch = None
        self.counters.add(rebalances=1)
        self.counters.last_epoch = cmap.epoch
        self.counters.last_mb_per_s = round(result.mb_per_s, 1)
        log.info(
            "rebalance epoch %d (%s): %d keys, %d unowned; pushed %d (%.1f MB) to %d node(s), "
            "dropped %d, failed %d, no space %d, already there %d; %.2f s, %.1f MB/s",
            cmap.epoch,
            result.mode,
            result.keys_seen,
            result.keys_unowned,
            result.keys_pushed,
            result.bytes_pushed / 1e6,
            result.owners,
            result.keys_dropped,
            result.push_failures,
            result.push_no_space,
            result.keys_present,
            result.seconds,
            result.mb_per_s,
        )
        return result

    def _wait_for_old_puts(self, epoch: int, should_abort) -> bool:
        """True once no PUT admitted under an epoch below `epoch` is still storing; False
        after fence_timeout_s. Waits in slices so a newer map aborts it."""
        if self._fence is None:
            return True
        deadline = time.monotonic() + self.fence_timeout_s
        while True:
            left_s = deadline - time.monotonic()
            if self._fence(epoch, max(0.0, min(FENCE_SLICE_S, left_s))):
                return True
            if should_abort():
                raise RebalanceAborted()
            if left_s <= FENCE_SLICE_S:
                log.warning(
                    "epoch %d: PUTs admitted under an older map still storing after %.1f s "
                    "(a slow writer); listing keys anyway, and once more at the end",
                    epoch,
                    self.fence_timeout_s,
                )
                return False

    def _scan(self, scan: _Scan) -> None:
        """One pass over the local keys: moves every unowned one, keys_pending_max at a time.
        Moving removes keys from the store mid-scan; the cursor misses none that stay."""
        owners_of = scan.placement.write.owners
        me = self.node_id
        pending: dict[str, list] = {}
        pending_count = 0
        cursor = 0
        while True:
            if scan.should_abort():
                raise RebalanceAborted()
            cursor, keys = self._list_keys_page(cursor, self.keys_page)
            scan.result.keys_seen += len(keys)
            hashed = keys if self._placement_key is None else [self._placement_key(k) for k in keys]
            for key, owner in zip(keys, owners_of(hashed)):
                if owner is not None and owner != me:  # keys nobody owns stay
                    pending.setdefault(owner, []).append(key)
                    pending_count += 1
            del keys
            if pending_count and (pending_count >= self.keys_pending_max or cursor == 0):
                scan.result.keys_unowned += pending_count
                self._move(scan, pending)
                pending, pending_count = {}, 0
            if cursor == 0:
                return

    def _move(self, scan: _Scan, groups: dict[str, list]) -> None:
        """Pushes (or drops) {owner id: [keys]}, up to OWNER_LANES owners at once; an owner
        found unreachable in this run is not tried again for later keys (they count as
        failures, as its first ones did)."""
        result = scan.result
        if scan.drop:
            for owner_keys in groups.values():
                if scan.should_abort():
                    raise RebalanceAborted()
                self._drop(owner_keys, result)
            return
        tasks = []
        for owner_id, owner_keys in groups.items():
            if owner_id in scan.unreachable:
                self._count_unreachable(len(owner_keys), result)
                continue
            node = scan.cmap.node(owner_id)
            if node is None:  # cannot happen: an owner of this map
                raise RuntimeError("invariant broken: an owner of this map")
            client = scan.clients.get(owner_id)
            if client is None:
                client = scan.clients[owner_id] = self._owner_client(node.address, scan.cmap.epoch)
            tasks.append((owner_id, node.address, client, owner_keys))
        if scan.should_abort():
            raise RebalanceAborted()
        futures = [scan.pushers.submit(self._push_owner, scan, *task) for task in tasks]
        concurrent.futures.wait(futures)  # each is bounded: socket timeouts, abort checks per batch
        if scan.failures:
            raise scan.failures[0]  # the first one; the others stopped because of it

    def _push_owner(self, scan: _Scan, owner_id: str, address: str, client, keys: list) -> None:
        """One owner's keys, in a lane of its own (a pusher thread)."""
        lane = scan.free_lanes.get_nowait()  # never empty: as many lanes as pusher threads
        try:
            if scan.repeat:
                keys = self._skip_present(client, address, keys, scan.keep, scan.result)
            if not self._push_group(client, address, keys, scan, lane):
                scan.unreachable.add(owner_id)
        except BaseException as e:
            scan.failures.append(e)
            scan.stop.set()  # the other lanes stop at their next batch
            raise
        finally:
            scan.free_lanes.put(lane)

    def _owner_client(self, address: str, epoch: int):
        return self._client_class(  # type: ignore[abstract, call-arg]  # as self._local's
            address, timeout_s=CLIENT_TIMEOUT_S, pool_size=1, retries=1, epoch=epoch, token=self._token
        )

    # -- removing -------------------------------------------------------------

    def _remove(self, keys: list) -> int:
        if not keys:
            return 0
        if self._remove_keys is not None:
            self._remove_keys(keys)
        else:
            for lo in range(0, len(keys), self.batch_keys):
                self._local.batch_remove(keys[lo : lo + self.batch_keys])
        return len(keys)

    def _drop(self, keys: list, result: RebalanceResult) -> int:
        for lo in range(0, len(keys), self.batch_keys):
            self._remove(keys[lo : lo + self.batch_keys])
        result.keys_dropped += len(keys)
        self.counters.add(keys_dropped=len(keys))
        return len(keys)

    # -- pushing --------------------------------------------------------------

    def _tally(self, result: RebalanceResult, **deltas) -> None:
        """Adds to `result` (lanes share it)."""
        with self._result_lock:
            for name, delta in deltas.items():
                setattr(result, name, getattr(result, name) + delta)

    def _count_unreachable(self, count: int, result: RebalanceResult) -> None:
        self._tally(result, push_failures=count, push_unreachable=count)
        self.counters.add(push_failures=count)

    def _skip_present(self, client, address: str, keys: list, keep: bool, result: RebalanceResult) -> list:
        """The keys the owner does not have yet (one EXISTS round trip per 4096 keys); the
        others are done: removed here unless `keep`. On a connection error, all of `keys`
        (the push finds out whether the owner is reachable)."""
        try:
            present = client.batch_is_exist(keys)
        except errors.StaleEpochError as e:
            raise RebalanceAborted(f"{address} has a newer map") from e
        except (errors.ConnectionError, errors.TimeoutError):
            return keys
        done = [k for k, ok in zip(keys, present) if ok]
        self._tally(result, keys_present=len(done))
        if done and not keep:
            for lo in range(0, len(done), self.batch_keys):
                self._remove(done[lo : lo + self.batch_keys])
        return [k for k, ok in zip(keys, present) if not ok]

    def _push_group(self, client, address: str, keys: list, scan: _Scan, lane: _Lane) -> bool:
        """Pushes `keys` to one owner, removing them locally unless scan.keep; False if the
        owner could not be reached (the rest of `keys` stay, counted as failures).

        The lane's reader reads batch i+1 into one buffer while batch i is pushed from the
        other; only it touches `queue` while a read is in flight, and batch i+2 is read into
        batch i's buffer only after batch i's push returned. No read is in flight on return."""
        result = scan.result

        def aborted() -> bool:
            return scan.stop.is_set() or scan.should_abort()

        queue = collections.deque(keys)
        turn = 0
        reading = scan.readers.submit(self._read_batch, queue, lane, turn) if queue else None
        try:
            while reading is not None:
                if aborted():
                    raise RebalanceAborted()
                buffer, batch, offsets, sizes = reading.result()
                reading = None
                if queue:
                    turn ^= 1
                    reading = scan.readers.submit(self._read_batch, queue, lane, turn)
                if not batch:
                    continue
                stored = self._put(client, address, buffer, batch, offsets, sizes, result, aborted)
                if stored is None:  # owner unreachable: the agent retries this map later
                    unpushed = len(batch)
                    if reading is not None:
                        unpushed += len(reading.result()[1])
                        reading = None
                    self._count_unreachable(unpushed + len(queue), result)
                    return False
                done = [k for k, ok in zip(batch, stored) if ok]
                nbytes = sum(s for s, ok in zip(sizes, stored) if ok)
                self._tally(result, keys_pushed=len(done), bytes_pushed=nbytes)
                self.counters.add(keys_pushed=len(done), bytes_pushed=nbytes)
                if not scan.keep:
                    self._remove(done)
            return True
        finally:
            if reading is not None:  # leaving early: the lane's buffers are free only after it
                concurrent.futures.wait([reading])

    def _read_batch(self, queue: collections.deque, lane: _Lane, turn: int) -> tuple[bytearray, list, list, list]:
        """Reads the next keys of `queue` into the lane's buffer `turn` (a reader thread):
        (that buffer, found keys, offsets, sizes)."""
        if self._slot_bytes:
            slot = self._slot_bytes
            n = max(1, min(self.batch_keys, self.lane_batch_bytes // slot, len(queue)))
        else:
            n = min(PROBE_KEYS, len(queue))
            slot = max(1, self.lane_batch_bytes // n)
        keys = [queue.popleft() for _ in range(n)]
        if len(lane.buffers[turn]) < n * slot:
            lane.buffers[turn] = bytearray(n * slot)
        buffer = lane.buffers[turn]
        slot_offsets = [i * slot for i in range(n)]
        try:
            lens = self._local.batch_get_into(keys, buffer, sizes=[slot] * n, offsets=slot_offsets)
        except errors.BufferTooSmallError as e:
            if e.results is None:  # cannot happen: the client sets the batch's per-key answers
                raise RuntimeError("invariant broken: the client sets the batch's per-key answers") from e
            lens = e.results  # None for the keys that did not fit: read them again
            queue.extendleft(reversed(e.keys))
            self._learn_slot(max(e.sizes))
        found = [(k, o, s) for k, o, s in zip(keys, slot_offsets, lens) if s is not None]
        if found:
            self._learn_slot(max(1, max(s for _, _, s in found)))
        # Misses: evicted or removed since listed; nothing to move.
        return buffer, [k for k, _, _ in found], [o for _, o, _ in found], [s for _, _, s in found]

    def _learn_slot(self, size_bytes: int) -> None:
        with self._slot_lock:  # lanes' readers learn at once; the slot only grows
            self._slot_bytes = max(self._slot_bytes, size_bytes)

    def _put(self, client, address: str, buffer, keys, offsets, sizes, result, should_abort) -> list | None:
        """Per-key True (stored / already there), False (refused); None if unreachable."""
        for attempt in range(PUSH_ATTEMPTS):
            if attempt and should_abort():
                raise RebalanceAborted()
            too_large = 0
            try:
                stored = client.batch_put_from(keys, buffer, sizes=sizes, offsets=offsets)
            except errors.StaleEpochError as e:
                raise RebalanceAborted(f"{address} has a newer map") from e
            except errors.ValueTooLargeError as e:
                stored, too_large = e.results, len(e.keys)
                self._tally(result, push_failures=too_large)
                self.counters.add(push_failures=too_large)
                log.warning(
                    "%s refused %d value(s) as too large (its --value-bytes-max is "
                    "smaller than this node's); they stay here",
                    address,
                    too_large,
                )
            except (errors.ConnectionError, errors.TimeoutError) as e:
                if attempt + 1 < PUSH_ATTEMPTS:
                    time.sleep(PUSH_BACKOFF_S * 2**attempt)
                    continue
                log.warning("cannot push to %s: %s; its keys stay here, retried later", address, e)
                return None
            no_space = sum(1 for ok in stored if not ok) - too_large
            if no_space:
                self._tally(result, push_no_space=no_space)
                self.counters.add(push_no_space=no_space)
            return stored
        return None


class _Lane:
    """Two buffers that take turns: one is pushed from while the reader fills the other."""

    def __init__(self):
        self.buffers = [bytearray(0), bytearray(0)]


@dataclass
class _Scan:
    """What one run's passes share."""

    cmap: ClusterMap
    placement: Placement
    drop: bool
    keep: bool
    result: RebalanceResult
    should_abort: Callable[[], bool]
    repeat: bool  # the last run for this map left keys unpushed
    pushers: ThreadPoolExecutor  # one thread per lane: pushes one owner's keys
    readers: ThreadPoolExecutor  # one thread per lane: reads its next batch
    free_lanes: queue_module.SimpleQueue = field(default_factory=queue_module.SimpleQueue)
    stop: threading.Event = field(default_factory=threading.Event)  # a lane failed: the others stop
    failures: list = field(default_factory=list)  # lanes' exceptions, first first
    clients: dict = field(default_factory=dict)  # owner id -> Client, closed at the end
    unreachable: set = field(default_factory=set)  # owner ids that failed in this run


def rebalance(
    cmap: ClusterMap,
    node_id: str,
    local_address: str,
    *,
    list_keys_page,
    remove_keys=None,
    fence=None,
    drop: bool = False,
    batch_bytes: int = 64 << 20,
    counters: RebalanceCounters | None = None,
    **options,
) -> RebalanceResult:
    """One rebalance for `cmap` with a fresh Rebalancer (tests and tools); options go to
    Rebalancer (keys_pending_max, keys_page, fence_timeout_s, batch_keys)."""
    rebalancer = Rebalancer(
        node_id,
        local_address,
        list_keys_page=list_keys_page,
        remove_keys=remove_keys,
        fence=fence,
        batch_bytes=batch_bytes,
        counters=counters,
        **options,
    )
    try:
        return rebalancer.run(cmap, drop=drop)
    finally:
        rebalancer.close()
