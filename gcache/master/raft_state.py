"""The map state machine replicated with Raft (pysyncobj).

`ReplicatedMap` (a pysyncobj consumer) holds a gcache.master.state.MapState and
exposes each state change as a @replicated command. Applying a command is
deterministic, with one local side effect: every replica stamps, in a table
that is not replicated, the monotonic time at which it applied a node's
register or heartbeat. Heartbeats are Raft commands precisely so that this
table is fresh on every replica, and so on whichever one is (or becomes) the
leader. Log compaction keeps the journal bounded despite them.

`MasterRaft` (the SyncObj) owns the Raft node: journal and full dump in the
data dir, fast-but-stable timeouts, and `apply`, which turns pysyncobj
failures into RaftUnavailableError (callers answer UNAVAILABLE: retry).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.syncobj import SyncObjException

from gcache.cluster.cluster_map import ClusterMap
from gcache.master.state import DEAD, UNKNOWN, MapState, StateError

log = logging.getLogger("gcache.master")

COMMANDS = ("register", "heartbeat", "drain", "remove", "expire", "activate", "finish_drain")
JOURNAL_FILE = "raft.journal"
DUMP_FILE = "raft.dump"
COMMANDS_QUEUE_MAX = 1024  # pending commands on one replica; beyond: QUEUE_FULL -> UNAVAILABLE
LOG_COMPACTION_ENTRIES = 2000  # heartbeats are log entries: compact often enough to bound the journal
LOG_COMPACTION_TIME_S = 60

_FAIL_TEXT = {
    FAIL_REASON.QUEUE_FULL: "too many pending commands on this replica",
    FAIL_REASON.MISSING_LEADER: "no Raft leader (election in progress, or no majority of masters reachable)",
    FAIL_REASON.DISCARDED: "the Raft leader changed before the command committed",
    FAIL_REASON.NOT_LEADER: "the Raft leader changed before the command committed",
    FAIL_REASON.LEADER_CHANGED: "the Raft leader changed before the command committed",
    FAIL_REASON.REQUEST_DENIED: "the Raft leader refused the command",
    FAIL_REASON.UNKNOWN_OUTCOME: "the command's outcome is unknown",
    "Timeout": "no Raft commit in time (no leader, or no majority of masters reachable)",
}


class RaftUnavailableError(Exception):
    """The command did not commit (no leader, no quorum, leader change, timeout): retry."""


class Snapshot(NamedTuple):
    map: ClusterMap
    rebalanced: dict  # node id -> epoch
    last_seen: dict  # node id -> monotonic time this replica applied its last heartbeat/register


class ReplicatedMap(SyncObjConsumer):
    """The replicated MapState. Commands return ("ok", payload) or ("error", code, message):
    an apply must never raise (pysyncobj would retry the same entry forever)."""

    def __init__(
        self, on_change: Callable[[str, ClusterMap], None] | None = None, clock: Callable[[], float] = time.monotonic
    ):
        super().__init__()
        self._lock = threading.Lock()
        self._state = MapState()
        self._last_seen: dict[str, float] = {}
        self._on_change = on_change
        self._clock = clock

    # -- the Raft full dump: plain dicts only, no locks or callbacks -----------

    def _serialize(self):
        with self._lock:
            return self._state.to_dict()

    def _deserialize(self, data):
        state = MapState.from_dict(data)
        with self._lock:
            self._state = state
        log.info("loaded the Raft dump: map epoch %d, %d nodes", state.map.epoch, len(state.map.nodes))

    # -- reads (any thread) ----------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._state.map, self._state.rebalanced, dict(self._last_seen))

    @property
    def map(self) -> ClusterMap:
        return self._state.map  # one attribute read of an immutable value

    # -- commands (applied by pysyncobj's thread, in log order, on every replica) --

    @replicated
    def register(self, node_id, address, weight, admin):
        def run(s: MapState):
            state, change = s.register(node_id, address, weight, admin)
            return {"map": s.map, "state": state}, change

        return self._apply(run, stamp=node_id)

    @replicated
    def heartbeat(self, node_id, rebalanced_epoch, degraded):
        def run(s: MapState):
            state, change = s.heartbeat(node_id, rebalanced_epoch, degraded)
            return {"epoch": s.map.epoch, "state": state}, change

        return self._apply(run, stamp=node_id)

    @replicated
    def drain(self, node_id):
        return self._apply(lambda s: self._map_after(s, s.drain(node_id)))

    @replicated
    def remove(self, node_id):
        return self._apply(lambda s: self._map_after(s, s.remove(node_id)))

    @replicated
    def expire(self, node_id, changed_epoch, forced=False):
        return self._apply(lambda s: self._map_after(s, s.expire(node_id, changed_epoch)))

    @replicated
    def activate(self, node_id, changed_epoch, forced=False):
        return self._apply(lambda s: self._map_after(s, s.activate(node_id, changed_epoch, forced)))

    @replicated
    def finish_drain(self, node_id, changed_epoch, forced=False):
        return self._apply(lambda s: self._map_after(s, s.finish_drain(node_id, changed_epoch, forced)))

    @staticmethod
    def _map_after(s: MapState, change):
        return {"map": s.map}, change

    def _apply(self, run, stamp: str | None = None):
        try:
            with self._lock:
                payload, change = run(self._state)
                node_state = self._state.state_of(stamp) if stamp else UNKNOWN
                if stamp and node_state not in (UNKNOWN, DEAD):
                    self._last_seen[stamp] = self._clock()
                if change:
                    for gone in set(self._last_seen) - {n.id for n in self._state.map.nodes}:
                        del self._last_seen[gone]
                new_map = self._state.map
        except StateError as e:
            return ("error", e.code, str(e))
        except Exception as e:  # a bug: refuse this command, keep the replica applying the log
            log.exception("applying a Raft command failed; the command is refused")
            return ("error", "internal", f"{type(e).__name__}: {e}")
        if change and self._on_change is not None:
            try:
                self._on_change(change, new_map)
            except Exception:
                log.exception("map change listener failed")
        return ("ok", payload)


class MasterRaft(SyncObj):
    """This replica's Raft node. Attributes are set before SyncObj.__init__ on purpose:
    pysyncobj pickles into its dump every attribute added after it, and these are local."""

    def __init__(
        self,
        self_address: str,
        peers: list[str],
        data_dir: str,
        replicated_map: ReplicatedMap,
        bind_address: str | None = None,
    ):
        self.self_address = self_address
        self.replicated_map = replicated_map
        os.makedirs(data_dir, exist_ok=True)
        conf = SyncObjConf(
            journalFile=os.path.join(data_dir, JOURNAL_FILE),
            fullDumpFile=os.path.join(data_dir, DUMP_FILE),
            bindAddress=bind_address or None,
            # Takeover within ~1-2 s of a leader's death, yet no spurious elections on a
            # loaded box: a follower waits 0.8-1.6 s of silence; the leader pings every 0.1 s.
            appendEntriesPeriod=0.1,
            raftMinTimeout=0.8,
            raftMaxTimeout=1.6,
            autoTickPeriod=0.02,  # idle poll wait: bounds a lone replica's commit latency
            connectionTimeout=3.5,
            connectionRetryTime=0.5,
            leaderFallbackTimeout=3.0,  # a cut-off leader steps down (default 30 s)
            appendEntriesUseBatch=False,  # control plane: low latency per command beats throughput
            commandsQueueSize=COMMANDS_QUEUE_MAX,
            # Without a leader, fail at once (UNAVAILABLE: the caller retries) rather than queue a
            # command that would apply long after its caller gave up on it.
            commandsWaitLeader=False,
            logCompactionMinEntries=LOG_COMPACTION_ENTRIES,
            logCompactionMinTime=LOG_COMPACTION_TIME_S,
            useFork=False,  # never fork a process that runs gRPC threads
            dnsCacheTime=5.0,
            dnsFailCacheTime=1.0,  # peers' IPs change on restart (Kubernetes)
            bindRetryTime=0.3,
            maxBindRetries=3,
        )
        super().__init__(self_address, list(peers), conf, consumers=[replicated_map])

    # -- commands ----------------------------------------------------------------

    def apply(self, command: str, *args, timeout_s: float):
        """Runs a replicated command (forwarded to the leader by pysyncobj) and waits for it to
        be applied here. Returns its payload; raises StateError or RaftUnavailableError."""
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}")
        method = getattr(self.replicated_map, command)
        try:
            result = method(*args, sync=True, timeout=max(0.05, timeout_s))
        except SyncObjException as e:
            reason = _FAIL_TEXT.get(e.errorCode, f"pysyncobj error {e.errorCode!r}")
            raise RaftUnavailableError(f"{reason}; retry") from None
        if result is None:  # the entry was applied as another command's (should not happen)
            raise RaftUnavailableError("the command's outcome is unknown; retry")
        if result[0] == "error":
            raise StateError(result[1], result[2])
        return result[1]

    # -- reads -------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        return self.replicated_map.snapshot()

    def is_leader(self) -> bool:
        return self._isLeader()

    def leader(self) -> str | None:
        node = self._getLeader()
        return node.id if node is not None else None

    def term(self) -> int:
        return self.raftCurrentTerm

    def raft_status(self) -> dict:
        leader = self.leader()
        return {
            "self": self.self_address,
            "leader": leader,
            "is_leader": self.is_leader(),
            "term": self.raftCurrentTerm,
            "ready": leader is not None,
            "has_quorum": bool(self.hasQuorum),
            "commit_index": self.raftCommitIndex,
            "last_applied": self.raftLastApplied,
            "peers": sorted(n.id for n in self.otherNodes),
        }

    def close(self) -> None:
        """Stops the Raft thread and closes the journal (flushed to the page cache)."""
        try:
            self.destroy_synchronous()
        except Exception:
            log.exception("stopping the Raft node failed")
