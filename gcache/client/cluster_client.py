"""gcache.ClusterClient: one client for a whole GCache cluster ("gcache://m1:p,m2:p").

Same methods as the single-node gcache.Client. Every call groups its keys by
their owner in the current cluster map (gcache.cluster.placement), runs each
owner's part on that node's single-node Client, in parallel when there are
several owners, and merges the answers back in the caller's key order.

  - A node that cannot answer (refused, reset, timeout, busy, shutting down)
    turns its keys into misses (None / False) and becomes *suspect* for
    suspect_s: later calls skip it at once instead of waiting on it again, and
    a map refresh is requested. A dead peer is never an exception.
  - While a node joins or drains (map.migrating), a read that misses at the
    owner is retried at the key's previous owner (the dual read), and a remove
    goes to both.
  - Every request carries the map's epoch; a node with a newer map refuses it
    (StaleEpochError). The client adopts the node's map (or waits, bounded, for
    one from the masters) and retries that part split by the new owners, at
    most STALE_EPOCH_RETRIES_MAX times; keys still refused are misses.
  - Argument errors and per-key problems (value too large, buffer too small,
    checksum mismatch) raise as in the single-node client, after every part has
    run; the exception's `results` holds the whole batch's answers.

Buffers are never copied here: the caller's buffers are sliced into one
memoryview per key and each node's views are handed to its Client.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import msgpack

from gcache import errors
from gcache.client import deadline as call_deadline
from gcache.client.api import Client
from gcache.client.map_source import MapSource
from gcache.client.node_set import NodeClient, NodeSet
from gcache.client.transports.choose import transport_kind
from gcache.cluster.cluster_map import DEAD, ClusterMap
from gcache.cluster.master_api import MasterCredentials, parse_master_url
from gcache.cluster.placement import Placement
from gcache.wire.protocol import normalize_keys
from gcache.wire.worth import Worth

log = logging.getLogger(__name__)

STALE_EPOCH_RETRIES_MAX = 3
PARALLEL_MAX_LIMIT = 256
SUSPECT_S_MAX = 3600.0

# "This node cannot answer now": its keys are misses and it becomes suspect.
# (ServerBusyError and ServerShuttingDownError are ConnectionErrors, and a pool
# whose connections all hang on a stopped node raises PoolExhaustedError, a
# TimeoutError.)
NODE_FAILURES = (errors.ConnectionError, errors.TimeoutError)
# Per-key problems: the node handled the part's other keys; raised after the batch.
KEY_PROBLEMS = (errors.ValueTooLargeError, errors.BufferTooSmallError, errors.ChecksumMismatchError)


COUNTERS = ("node_errors", "suspect_skips", "fallback_reads", "fallback_hits", "stale_epoch_retries")


class Outcome(enum.StrEnum):
    """How one owner's part of a call ended (_run_part); the payload that goes with it."""

    OK = "ok"  # answers: the part's values, in its keys' order
    MISS = "miss"  # None: the node is dead, suspect or just failed; its keys are misses
    STALE = "stale"  # StaleEpochError: the node has a newer map; retry by the new owners
    RETRY = "retry"  # None: a newer map closed this node's client mid-call; retry
    PROBLEM = "problem"  # a KEY_PROBLEMS error: per-key problems, raised after the batch
    ERROR = "error"  # any other exception: raised in the caller's thread


class _Routing(NamedTuple):
    """Everything derived from one map; swapped as a whole, so a call sees one map."""

    placement: Placement
    nodes: dict  # node id -> NodeInfo
    epoch: int


# A per-key problem a part reports after serving the rest of its keys (Outcome.PROBLEM)
PartialError = errors.ValueTooLargeError | errors.BufferTooSmallError | errors.ChecksumMismatchError


class _Call:
    """One call's answers (caller's key order) and what went wrong along the way."""

    __slots__ = ("values", "miss", "merged", "problems", "deadline")

    def __init__(self, n: int, miss, deadline: call_deadline.Deadline):
        self.values = [miss] * n
        self.miss = miss
        self.merged = False  # False: every value is still `miss`
        self.problems: list[PartialError] = []
        self.deadline = deadline  # the whole call's: every phase, part and map wait

    def missed(self, i: int) -> bool:
        v = self.values[i]
        return v is None or v is False


def _pick(seq: list, idx: list[int]) -> list:
    """seq's items at idx. Index lists (Placement.group, fallback_group, retries)
    hold distinct positions in increasing order, so one as long as seq is all of
    it: seq itself is passed on, not copied."""
    return seq if len(idx) == len(seq) else [seq[i] for i in idx]


class ClusterClient(Client):
    """Client of a GCache cluster. Thread-safe; use one per process.

    address: "gcache://host:port[,host:port...]", the gcache-master replicas.
        May be None when `initial_map` is given (no refreshes then).
    initial_map: a ClusterMap to start from instead of asking a master at
        start; the masters (if any) are then only used for refreshes and may be
        unreachable.
    timeout_s, connect_timeout_s, pool_size, retries, verify_checksums and any
        other keyword: passed to each node's single-node gcache.Client
        (timeout_s defaults to TIMEOUT_S_DEFAULT, 5 s, as there).
    call_timeout_s: the most one call may take in all (default timeout_s *
        (retries + 1)): one deadline (gcache.client.deadline) carried through
        every phase (the owners' parts, waiting for a newer map, the stale-epoch
        retries, the dual read) and every node's attempts, waits and backoffs,
        even when a node accepts connections but never answers. Keys not
        answered by then are misses (None / False), as for a node that failed.
    map_refresh_s: how often the map is fetched from the masters.
    suspect_s: how long a node that failed is skipped.
    parallel_max: threads running owners' parts at once (shared by all calls).
    master_timeout_s: per master RPC.
    token: the tenant token (else $GCACHE_TOKEN / $GCACHE_TOKEN_FILE), used towards the
        nodes (challenge-response) and the masters (a bearer token).
    tls_ca: CA of the masters' TLS certificates (else $GCACHE_MASTER_TLS_CA); None:
        plaintext gRPC to the masters.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float = call_deadline.TIMEOUT_S_DEFAULT,
        call_timeout_s: float | None = None,
        connect_timeout_s: float = 0.5,
        pool_size: int = 8,
        retries: int = 1,
        verify_checksums: bool = False,
        map_refresh_s: float = 2.0,
        suspect_s: float = 1.0,
        parallel_max: int = 16,
        initial_map: ClusterMap | None = None,
        master_timeout_s: float = 2.0,
        token: str | None = None,
        tls_ca: str | None = None,
        **node_kwargs,
    ):
        if address is None and initial_map is None:
            raise errors.InvalidArgumentError(
                "ClusterClient needs the masters, 'gcache://host:port[,host:port...]', or initial_map=ClusterMap(...)"
            )
        masters = parse_master_url(address) if address is not None else None
        if initial_map is not None and not isinstance(initial_map, ClusterMap):
            raise errors.InvalidArgumentError(
                f"initial_map must be a gcache.cluster.cluster_map.ClusterMap, got "
                f"{type(initial_map).__name__} (ClusterMap.from_dict builds one from a dict)"
            )
        if not 1 <= parallel_max <= PARALLEL_MAX_LIMIT:
            raise errors.InvalidArgumentError(f"parallel_max must be in [1, {PARALLEL_MAX_LIMIT}]")
        if not 0 <= suspect_s <= SUSPECT_S_MAX:
            raise errors.InvalidArgumentError(f"suspect_s must be in [0, {SUSPECT_S_MAX}]")
        if not 0 < map_refresh_s <= 3600 or not 0 < master_timeout_s <= 3600:
            raise errors.InvalidArgumentError("map_refresh_s and master_timeout_s must be in (0, 3600]")
        try:
            credentials = MasterCredentials.from_env(token=token, tls_ca=tls_ca)
        except ValueError as exc:
            raise errors.InvalidArgumentError(str(exc)) from None
        node_kwargs.update(
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            pool_size=pool_size,
            retries=retries,
            verify_checksums=verify_checksums,
            token=credentials.token,
        )
        # Bad node options fail here, not later (a probe that connects nowhere and
        # picks no transport; the transport name itself is checked on its own).
        transport_kind(node_kwargs.get("transport"))
        NodeClient("127.0.0.1:1", **{**node_kwargs, "transport": "tcp"}).close()
        self.address = address
        self.timeout_s = timeout_s
        self.call_timeout_s = call_deadline.call_timeout_for(timeout_s, retries, call_timeout_s)
        self.retries = retries
        self.parallel_max = parallel_max
        self._node_kwargs = node_kwargs
        super().__init__()
        self._closed = False
        self._counter_lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._nodes = NodeSet(lambda addr: NodeClient(addr, **self._node_kwargs), suspect_s)
        # set by _on_map, which MapSource's constructor calls (or it raises)
        self._routing: _Routing
        self._maps = MapSource(
            masters,
            self._on_map,
            initial_map=initial_map,
            refresh_s=map_refresh_s,
            master_timeout_s=master_timeout_s,
            credentials=credentials,
        )

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Stops the map refresher and closes every node's connections; later calls raise."""
        if self._closed:
            return
        self._closed = True
        self._maps.close()
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
        self._nodes.close()
        self._drop_device_staging()

    def __repr__(self) -> str:
        masters = ",".join(self._maps.masters) or None
        cmap = self._maps.current
        return f"gcache.ClusterClient(masters={masters!r}, epoch={cmap.epoch}, nodes={len(cmap.nodes)})"

    @property
    def cluster_map(self) -> ClusterMap:
        """The newest map this client has seen."""
        return self._maps.current

    def client_stats(self) -> dict:
        """This client's own counters (not the nodes'): see COUNTERS, plus map_refreshes
        (master answers received) and map_updates (newer maps adopted)."""
        with self._counter_lock:
            out = dict(self._counters)
        out["map_refreshes"] = self._maps.refreshes
        out["map_updates"] = self._maps.adoptions
        return out

    def refresh_map(self) -> bool:
        """Fetches the map from the masters now, in this thread; True if it was newer."""
        return self._maps.refresh_once()

    # -- map -> routing ---------------------------------------------------------

    def _on_map(self, cmap: ClusterMap) -> None:
        # Placement first, then close clients of nodes that left: a call that
        # still holds the old routing and hits a closed client retries (see _run_part).
        self._routing = _Routing(Placement(cmap), {n.id: n for n in cmap.nodes}, cmap.epoch)
        self._nodes.sync(cmap)

    def _count(self, name: str, k: int = 1) -> None:
        if k:
            with self._counter_lock:
                self._counters[name] += k

    def _check_open(self) -> None:
        if self._closed:
            raise errors.ClientClosedError("this gcache ClusterClient was closed; create a new one")

    # -- running parts ----------------------------------------------------------

    def _run_part(
        self, routing: _Routing, node_id: str, idx: list[int], fn, deadline: call_deadline.Deadline
    ) -> tuple[Outcome, Any]:
        """(Outcome, payload): OK/answers, MISS, STALE/exc, RETRY, PROBLEM/exc, ERROR/exc."""
        node = routing.nodes.get(node_id)
        if node is None or node.state == DEAD:
            return Outcome.MISS, None
        if deadline.expired:  # the call's time went elsewhere: a miss, the node did nothing wrong
            return Outcome.MISS, None
        if self._nodes.is_suspect(node_id):
            self._count("suspect_skips", len(idx))
            return Outcome.MISS, None
        try:
            with call_deadline.using(deadline):
                client = self._nodes.client(node)
                with client.using_epoch(routing.epoch):
                    return Outcome.OK, fn(client, idx)
        except errors.StaleEpochError as exc:  # the node's map is newer than the request's
            return Outcome.STALE, exc
        except KEY_PROBLEMS as exc:
            return Outcome.PROBLEM, exc
        except NODE_FAILURES as exc:
            self._count("node_errors")
            self._nodes.mark_suspect(node_id)
            self._maps.request_refresh()
            log.debug(
                "gcache node %s (%s) failed, suspect for %ss: %s", node_id, node.address, self._nodes.suspect_s, exc
            )
            return Outcome.MISS, None
        except errors.ClientClosedError as exc:
            if self._closed:
                return Outcome.ERROR, exc
            return Outcome.RETRY, None  # a newer map closed this node's client mid-call
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            return Outcome.ERROR, exc

    def _executor_get(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            self._check_open()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.parallel_max, thread_name_prefix="gcache-part")
            return self._executor

    def _run_parts(
        self, routing: _Routing, parts: list[tuple[str, list[int]]], fn, deadline
    ) -> list[tuple[Outcome, Any]]:
        if len(parts) == 1:
            return [self._run_part(routing, *parts[0], fn, deadline)]
        # Every part is waited for, even after another failed: a part still running
        # could otherwise write into a caller's buffer after the call returned.
        # Each part is bounded by its node Client's timeouts.
        futures = []
        try:
            for nid, idx in parts[1:]:
                futures.append(self._executor_get().submit(self._run_part, routing, nid, idx, fn, deadline))
        except (RuntimeError, errors.ClientClosedError):  # close() raced this call
            for f in futures:
                if not f.cancel():
                    f.exception()  # wait: a running part may still write into a caller's buffer
            raise errors.ClientClosedError("this gcache ClusterClient was closed; create a new one") from None
        first = self._run_part(routing, *parts[0], fn, deadline)
        return [first] + [f.result() for f in futures]

    def _execute(self, routing: _Routing, groups: dict, fn, call: _Call) -> list[int]:
        """Runs each node's part of `groups` ({node id: [key indexes]}), merging hits into
        call.values; returns the indexes to retry with a newer map, in increasing order."""
        if len(groups) == 1:  # one owner (every single-key call): no lists, no threads
            ((nid, idx),) = groups.items()
            if nid is None:  # no owner
                return []
            kind, payload = outcome = self._run_part(routing, nid, idx, fn, call.deadline)
            if kind == Outcome.OK:
                self._merge(call, idx, payload)
                return []
            parts, outcomes = [(nid, idx)], [outcome]
        else:
            parts = [(nid, idx) for nid, idx in groups.items() if nid is not None]
            if not parts:
                return []
            outcomes = self._run_parts(routing, parts, fn, call.deadline)
        retry: list[int] = []
        stale: list = []
        error: BaseException | None = None
        for (nid, idx), (kind, payload) in zip(parts, outcomes):
            if kind == Outcome.OK:
                self._merge(call, idx, payload)
            elif kind == Outcome.PROBLEM:
                if payload.results is not None:
                    self._merge(call, idx, payload.results)
                call.problems.append(payload)
            elif kind in (Outcome.STALE, Outcome.RETRY):
                retry.extend(idx)
                if kind == Outcome.STALE:
                    stale.append(payload)
            elif kind == Outcome.ERROR and error is None:
                error = payload
        if error is not None:
            raise error
        for exc in stale:
            self._adopt_from_stale(exc, call)
        if len(parts) > 1:
            retry.sort()  # parts each keep key order, but their concatenation does not
        return retry

    @staticmethod
    def _merge(call: _Call, idx: list[int], answers: list) -> None:
        # Only hits are written: a miss never hides a hit from another phase
        # (a remove that found the key at the owner or at the previous owner is True).
        values = call.values
        if not call.merged and len(idx) == len(values) == len(answers):
            # The whole batch, first answers: every value is still a miss.
            miss = call.miss
            call.values = [v if v is not None and v is not False else miss for v in answers]
        else:
            for i, v in zip(idx, answers):
                if v is not None and v is not False:
                    values[i] = v
        call.merged = True

    def _adopt_from_stale(self, exc, call: _Call) -> None:
        node_epoch = getattr(exc, "epoch", 0)
        map_bytes = getattr(exc, "map_bytes", b"")
        if map_bytes:
            try:
                self._maps.offer(ClusterMap.from_dict(msgpack.unpackb(map_bytes, raw=False)))
            except Exception as bad:  # noqa: BLE001 - the node's map is only a hint
                log.debug("ignoring an unreadable map in a STALE_EPOCH answer: %s", bad)
        if isinstance(node_epoch, int) and self._maps.current.epoch < node_epoch:
            # Bounded by the call's deadline, and by timeout_s: a map is one master RPC away.
            self._maps.wait_for_epoch(node_epoch, call.deadline.cap(self.timeout_s))

    def _batch(self, keys: list[bytes], miss, fn: Callable, *, read: bool = False, remove: bool = False) -> _Call:
        """Runs `fn(node_client, key_indexes) -> answers` for every owner's keys."""
        self._check_open()
        call = _Call(len(keys), miss, call_deadline.Deadline(self.call_timeout_s))
        if not keys:
            return call
        routing = self._routing
        todo = None  # every key
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            todo = self._execute(routing, routing.placement.group(keys, todo), fn, call)
            if not todo or attempt == STALE_EPOCH_RETRIES_MAX or self._routing is routing or call.deadline.expired:
                break  # done, out of retries or time, or no newer map to retry with: misses
            self._count("stale_epoch_retries")
            routing = self._routing
        if (read or remove) and routing.placement.migrating and not call.deadline.expired:
            self._fall_back(routing, keys, fn, call, count=read, every_key=remove)
        if call.problems:
            self._raise_problems(call)
        return call

    def _fall_back(self, routing: _Routing, keys, fn, call: _Call, count: bool, every_key: bool) -> None:
        """The dual read: keys that missed at their owner, at their previous owner."""
        candidates: range | list[int]
        if every_key:
            candidates = range(len(keys))
        else:
            candidates = [i for i, v in enumerate(call.values) if v is None or v is False]
        groups = routing.placement.fallback_group(keys, candidates)
        if not groups:
            return
        tried = [i for idx in groups.values() for i in idx]
        self._execute(routing, groups, fn, call)  # a stale node here: those keys stay misses
        if count:
            self._count("fallback_reads", len(tried))
            self._count("fallback_hits", sum(1 for i in tried if not call.missed(i)))

    @staticmethod
    def _raise_problems(call: _Call) -> None:
        """Raises the first per-key problem, with every part's keys of that kind."""
        first = call.problems[0]
        seen = set(first.keys)
        for other in call.problems[1:]:
            if type(other) is not type(first):
                continue
            # the sizes where first (of the same type) has them; else just a second walk of the keys
            sizes: list[Any] = other.sizes if isinstance(other, errors.BufferTooSmallError) else other.keys
            for key, size in zip(other.keys, sizes):
                if key not in seen:  # the same key may fail at its owner and its previous owner
                    seen.add(key)
                    first.keys.append(key)
                    if isinstance(first, errors.BufferTooSmallError):
                        first.sizes.append(size)
        first.results = call.values
        raise first

    # -- puts -----------------------------------------------------------------------

    def _put_views(
        self, keys: list[bytes], views: list[memoryview], worth: Sequence[Worth] | None = None
    ) -> list[bool]:
        # Routed by owner; a put whose owner is down returns False, like one the
        # node did not admit.
        def put_part(client, idx):
            # Keys and views are already checked: skip batch_put_from's second pass.
            return client._put_views(
                _pick(keys, idx), _pick(views, idx), None if worth is None else _pick(list(worth), idx)
            )

        return self._batch(keys, False, put_part).values

    # -- gets -------------------------------------------------------------------------

    def get(self, key):
        """The value as bytes, or None on a miss (or when its node is down)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys) -> list:
        keys = normalize_keys(keys)

        def get_part(client, idx):
            return client.get_batch(_pick(keys, idx))

        return self._batch(keys, None, get_part, read=True).values

    def _get_views(self, keys: list[bytes], views: list[memoryview]) -> list:
        def get_into_part(client, idx):
            return client._get_views(_pick(keys, idx), _pick(views, idx))  # keys, views checked

        return self._batch(keys, None, get_into_part, read=True).values

    # -- exists / remove ------------------------------------------------------------------

    def batch_is_exist(self, keys) -> list[bool]:
        keys = normalize_keys(keys)

        def exists_part(client, idx):
            return client._exists(_pick(keys, idx)).values  # keys already normalized

        return self._batch(keys, False, exists_part, read=True).values

    def batch_exists_prefix(self, keys) -> int:
        """How many leading keys exist (one EXISTS round trip per owner, plus the
        dual read while a node joins or drains)."""
        total = 0
        for found in self.batch_is_exist(keys):
            if not found:
                break
            total += 1
        return total

    def batch_remove(self, keys) -> list[bool]:
        keys = normalize_keys(keys)

        def remove_part(client, idx):
            return client.batch_remove(_pick(keys, idx))

        return self._batch(keys, False, remove_part, remove=True).values

    # -- control --------------------------------------------------------------------------

    def _per_node(self, method: str) -> dict:
        self._check_open()
        nodes = [n for n in self._routing.nodes.values() if n.state != DEAD]

        deadline = call_deadline.Deadline(self.call_timeout_s)  # one for the whole call

        def ask(node):
            try:
                with call_deadline.using(deadline):
                    return getattr(self._nodes.client(node), method)()
            except errors.GCacheError as exc:
                return f"{type(exc).__name__}: {exc}"

        if len(nodes) <= 1:
            return {n.id: ask(n) for n in nodes}
        futures = {n.id: self._executor_get().submit(ask, n) for n in nodes}
        return {nid: f.result() for nid, f in futures.items()}

    @property
    def transport(self) -> str | None:
        """The transport every node in use shares ("tcp", "shm", "rdma"), "mixed" when they
        differ, None before any node was used; node_transports() has each node's."""
        kinds = set(self.node_transports(connect=False).values())
        return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"

    def node_transports(self, connect: bool = True) -> dict[str, str]:
        """{node id: the transport its Client uses} for every live node in the map. connect:
        open a Client for nodes not used yet (as ping does); False: only those in use."""
        self._check_open()
        out = {}
        for node in self._routing.nodes.values():
            if node.state == DEAD:
                continue
            client = self._nodes.existing(node) if not connect else None
            if connect:
                try:
                    with call_deadline.using(call_deadline.Deadline(self.call_timeout_s)):
                        client = self._nodes.client(node)
                except errors.GCacheError as exc:
                    out[node.id] = f"{type(exc).__name__}: {exc}"
                    continue
            if client is not None:
                out[node.id] = client.transport
        return out

    def ping(self) -> dict:
        """{node id: the node's PING answer, or an error string} for every live node."""
        return self._per_node("ping")

    def stats(self) -> dict:
        """{node id: the node's STATS answer, or an error string} for every live node."""
        return self._per_node("stats")
