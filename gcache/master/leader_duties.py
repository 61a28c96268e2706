"""The leader's periodic duties: expire silent nodes, end migrations.

`plan` is pure: from the map, the rebalanced epochs, this replica's monotonic
heartbeat table and its migration clocks it lists the commands to issue. The
commands re-check their preconditions when Raft applies them
(gcache.master.state), so a plan made on a slightly stale view is harmless.

Only the leader runs them. Heartbeat ages count only after a grace of one
heartbeat timeout from the moment this replica became leader (its table may
lag the old leader's a little), and migration clocks restart on a leader
change: both only ever delay a decision, never hasten it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from gcache.cluster.cluster_map import DRAINING, JOINING, ClusterMap
from gcache.master.state import LIVE_STATES

log = logging.getLogger("gcache.master")

EXPIRE, ACTIVATE, FINISH_DRAIN = "expire", "activate", "finish_drain"
ACTIONS_PER_TICK_MAX = 64  # bound the Raft commands one tick may issue
# When more than half of the live nodes (of at least this many) fall silent at
# once, the likelier story is that this master is cut off from them (or stalled),
# not that they all died: expire none until they are heard again or fewer are silent.
MASS_EXPIRY_NODES_MIN = 3
MASS_EXPIRY_LOG_S = 10.0


class Action(NamedTuple):
    kind: str  # EXPIRE | ACTIVATE | FINISH_DRAIN
    node_id: str
    changed_epoch: int  # the entry the decision was made on; the command is a no-op if it moved on
    forced: bool = False


def silent_nodes(
    cluster_map: ClusterMap, last_seen: dict, now: float, leader_since: float, heartbeat_timeout_s: float
) -> list[str]:
    """Live nodes without a heartbeat for heartbeat_timeout_s (none during the grace after
    an election). `last_seen`: node id -> monotonic time of its last applied heartbeat
    (missing: treat as `leader_since`)."""
    if now - leader_since < heartbeat_timeout_s:
        return []
    return [
        n.id
        for n in cluster_map.nodes
        if n.state in LIVE_STATES and now - max(last_seen.get(n.id, leader_since), leader_since) > heartbeat_timeout_s
    ]


def mass_expiry(cluster_map: ClusterMap, silent: list[str]) -> bool:
    """Whether expiring `silent` would take more than half of the live nodes at once (held back)."""
    live = sum(1 for n in cluster_map.nodes if n.state in LIVE_STATES)
    return live >= MASS_EXPIRY_NODES_MIN and len(silent) > live // 2


def plan(
    cluster_map: ClusterMap,
    rebalanced: dict,
    last_seen: dict,
    migration_started: dict,
    now: float,
    leader_since: float,
    heartbeat_timeout_s: float,
    migration_timeout_s: float,
) -> list[Action]:
    """The commands due now. `last_seen`: see silent_nodes; `migration_started`: (node id,
    changed_epoch) -> monotonic time this leader first saw that migration."""
    actions = []
    silent = silent_nodes(cluster_map, last_seen, now, leader_since, heartbeat_timeout_s)
    expire = not mass_expiry(cluster_map, silent)
    for node in cluster_map.nodes:
        if node.state not in LIVE_STATES:
            continue
        if node.id in silent:
            if expire:
                actions.append(Action(EXPIRE, node.id, node.changed_epoch))
            continue
        started = migration_started.get((node.id, node.changed_epoch), now)
        timed_out = now - started > migration_timeout_s
        if node.state == JOINING:
            ready = all(
                rebalanced.get(o.id, 0) >= node.changed_epoch
                for o in cluster_map.nodes
                if o.id != node.id and o.state in LIVE_STATES
            )
            if ready or timed_out:
                actions.append(Action(ACTIVATE, node.id, node.changed_epoch, forced=not ready))
        elif node.state == DRAINING:
            done = rebalanced.get(node.id, 0) >= cluster_map.epoch
            if done or timed_out:
                actions.append(Action(FINISH_DRAIN, node.id, node.changed_epoch, forced=not done))
    return actions[:ACTIONS_PER_TICK_MAX]


def track_migrations(cluster_map: ClusterMap, migration_started: dict, now: float) -> dict:
    """Migration clocks for the nodes joining/draining now: kept if already running, else started at `now`."""
    return {
        (n.id, n.changed_epoch): migration_started.get((n.id, n.changed_epoch), now)
        for n in cluster_map.nodes
        if n.state in (JOINING, DRAINING)
    }


class LeaderDuties:
    """Runs `plan` every tick while this replica is the Raft leader, and logs leader changes.

    `raft` is a gcache.master.raft_state.MasterRaft (is_leader, leader, snapshot, apply).
    """

    def __init__(
        self,
        raft,
        heartbeat_timeout_s: float,
        migration_timeout_s: float,
        tick_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.raft = raft
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.migration_timeout_s = migration_timeout_s
        self.tick_s = tick_s
        self.clock = clock
        self._leader_since: float | None = None
        self._leader_term = -1
        self._migration_started: dict = {}
        self._known_leader = None
        self._mass_expiry_logged = -MASS_EXPIRY_LOG_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gcache-master-duties", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # a bug here must not stop the duties for good
                log.exception("leader duties tick failed; retrying next tick")

    def tick(self) -> list[Action]:
        """One round; returns the actions it issued (for tests and logs)."""
        now = self.clock()
        leader = self.raft.leader()
        if leader != self._known_leader:
            self._known_leader = leader
            log.info(
                "raft leader is now %s (term %d)%s",
                leader or "unknown",
                self.raft.term(),
                " - this replica" if leader and leader == self.raft.self_address else "",
            )
        if not self.raft.is_leader():
            self._leader_since = None
            self._migration_started = {}
            return []
        term = self.raft.term()
        if self._leader_since is None or term != self._leader_term:  # (re)gained leadership
            self._leader_since, self._leader_term = now, term
            self._migration_started = {}
            log.info("this replica leads: node heartbeats count after a grace of %.1fs", self.heartbeat_timeout_s)
        snap = self.raft.snapshot()
        self._migration_started = track_migrations(snap.map, self._migration_started, now)
        actions = plan(
            snap.map,
            snap.rebalanced,
            snap.last_seen,
            self._migration_started,
            now,
            self._leader_since,
            self.heartbeat_timeout_s,
            self.migration_timeout_s,
        )
        silent = silent_nodes(snap.map, snap.last_seen, now, self._leader_since, self.heartbeat_timeout_s)
        if mass_expiry(snap.map, silent) and now - self._mass_expiry_logged >= MASS_EXPIRY_LOG_S:
            self._mass_expiry_logged = now
            log.warning(
                "%d of the live nodes are silent (%s): more than half at once looks like "
                "this master being cut off, so none is declared dead",
                len(silent),
                ",".join(silent),
            )
        issued = []
        for action in actions:
            if self._stop.is_set() or not self.raft.is_leader():
                break
            try:
                self.raft.apply(
                    action.kind,
                    action.node_id,
                    action.changed_epoch,
                    action.forced,
                    timeout_s=max(1.0, self.tick_s * 5),
                )
            except Exception as e:  # no quorum right now: the next tick plans again
                log.warning("leader duty %s %s not committed (%s); retrying next tick", action.kind, action.node_id, e)
                break
            issued.append(action)
        return issued
