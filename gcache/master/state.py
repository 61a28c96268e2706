"""The master's replicated state machine: the cluster map plus each node's rebalanced epoch.

Pure and deterministic: no clocks, no I/O, no randomness. Every replica applies
the same commands in the same order (gcache.master.raft_state) and so reaches
the same state; the leader's time-based decisions (gcache.master.leader_duties)
arrive here as explicit commands whose preconditions are re-checked on apply,
so a decision taken on a stale view is a no-op instead of a wrong change.

Every change raises the map epoch by exactly one. Methods that change nothing
return None as their description; methods that change something return a short
text for the log ("n1 joining (new at 10.0.0.1:7600, weight 64)").
"""

from __future__ import annotations

from gcache.cluster.cluster_map import (
    ACTIVE,
    DEAD,
    DRAINING,
    JOINING,
    NODES_MAX,
    PLACEMENT_NEW,
    UNKNOWN,
    ClusterMap,
    MapError,
    NodeInfo,
)

LIVE_STATES = (JOINING, ACTIVE, DRAINING)
DEGRADED_CHARS_MAX = 200

# Error codes, mapped to gRPC status codes by the service.
NOT_FOUND = "not_found"
FAILED_PRECONDITION = "failed_precondition"
INVALID_ARGUMENT = "invalid_argument"


class StateError(Exception):
    """A command the state refuses; `code` is one of NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class MapState:
    """The cluster map and, per node, the newest epoch whose migration it finished pushing.

    `map` is an immutable ClusterMap and `rebalanced` a dict that is replaced, never
    mutated, on change, so a reader that grabs both under the owner's lock gets a
    consistent snapshot it can keep.
    """

    def __init__(self, cluster_map: ClusterMap | None = None, rebalanced: dict | None = None):
        # A new cluster starts with the newest placement; a loaded map keeps its own.
        self.map = cluster_map if cluster_map is not None else ClusterMap.empty(PLACEMENT_NEW)
        self.rebalanced = dict(rebalanced or {})

    # -- encoding (the Raft full dump) -------------------------------------

    def to_dict(self) -> dict:
        return {"map": self.map.to_dict(), "rebalanced": dict(self.rebalanced)}

    @classmethod
    def from_dict(cls, d: dict) -> MapState:
        state = cls(ClusterMap.from_dict(d["map"]), {str(k): int(v) for k, v in d["rebalanced"].items()})
        state.check_invariants()
        return state

    def check_invariants(self) -> None:
        """Raises MapError if the state breaks a rule every reachable state keeps."""
        m = self.map
        ids = [n.id for n in m.nodes]
        if ids != sorted(set(ids)):
            raise MapError(f"node ids must be unique and sorted, got {ids}")
        if m.epoch < 0:
            raise MapError(f"negative epoch {m.epoch}")
        for n in m.nodes:
            n.validate()
            if n.changed_epoch > m.epoch:
                raise MapError(f"node {n.id} changed at epoch {n.changed_epoch} > map epoch {m.epoch}")
        extra = set(self.rebalanced) - set(ids)
        if extra:
            raise MapError(f"rebalanced epochs kept for nodes not in the map: {sorted(extra)}")

    # -- reads --------------------------------------------------------------

    def node(self, node_id: str) -> NodeInfo | None:
        return self.map.node(node_id)

    def state_of(self, node_id: str) -> str:
        node = self.map.node(node_id)
        return node.state if node is not None else UNKNOWN

    def ready_to_activate(self, node_id: str) -> bool:
        """A joining node may turn active once every other live node rebalanced to its changed_epoch."""
        node = self.map.node(node_id)
        if node is None or node.state != JOINING:
            return False
        return all(
            self.rebalanced.get(o.id, 0) >= node.changed_epoch
            for o in self.map.nodes
            if o.id != node_id and o.state in LIVE_STATES
        )

    def drain_finished(self, node_id: str) -> bool:
        """A draining node may leave once it has pushed its keys for the current epoch."""
        node = self.map.node(node_id)
        return node is not None and node.state == DRAINING and self.rebalanced.get(node_id, 0) >= self.map.epoch

    # -- commands -----------------------------------------------------------

    def register(self, node_id: str, address: str, weight: int, admin: str = "") -> tuple[str, str | None]:
        """-> (the node's state, change description or None). See api.py Register."""
        old = self.map.node(node_id)
        fresh = NodeInfo(id=node_id, address=address, weight=weight, state=JOINING, admin=admin)
        try:
            fresh.validate()
        except MapError as e:
            raise StateError(INVALID_ARGUMENT, str(e)) from None
        if old is None:
            if len(self.map.nodes) >= NODES_MAX:
                raise StateError(
                    FAILED_PRECONDITION, f"the map already holds {NODES_MAX} nodes; remove dead ones first"
                )
            self._set_node(fresh)
            return JOINING, f"{node_id} joining (new at {address}, weight {weight})"
        if old.state == DEAD:
            self._set_node(fresh)
            return JOINING, f"{node_id} joining (was dead; at {address}, weight {weight})"
        if (old.address, old.weight, old.admin) == (address, weight, admin):
            return old.state, None  # a quick restart: nothing a reader cares about changed
        # Same live node, new address/weight/admin: keep its state, publish the new entry.
        self._set_node(old._replace(address=address, weight=weight, admin=admin))
        return old.state, (
            f"{node_id} {old.state}, updated: {old.address} weight {old.weight} -> {address} weight {weight}"
        )

    def heartbeat(self, node_id: str, rebalanced_epoch: int, degraded: str = "") -> tuple[str, str | None]:
        """-> (the node's state after the heartbeat, change description or None)."""
        node = self.map.node(node_id)
        if node is None:
            return UNKNOWN, None
        if node.state == DEAD:
            return DEAD, None
        # No node can have finished an epoch that does not exist yet (a buggy or forged report).
        rebalanced_epoch = min(rebalanced_epoch, self.map.epoch)
        if self.rebalanced.get(node_id) != rebalanced_epoch:
            self.rebalanced = {**self.rebalanced, node_id: rebalanced_epoch}
        if degraded and node.state == ACTIVE:
            self._set_node(node._replace(state=DRAINING))
            return DRAINING, f"{node_id} draining (node reports degraded: {degraded[:DEGRADED_CHARS_MAX]})"
        return node.state, None

    def drain(self, node_id: str) -> str | None:
        node = self._existing(node_id)
        if node.state == DEAD:
            raise StateError(
                FAILED_PRECONDITION, f"node {node_id} is dead and holds nothing to drain; Remove it instead"
            )
        if node.state == DRAINING:
            return None
        self._set_node(node._replace(state=DRAINING))
        return f"{node_id} draining (asked by an operator; was {node.state})"

    def remove(self, node_id: str) -> str:
        node = self._existing(node_id)
        self._drop_node(node_id)
        return f"{node_id} removed (asked by an operator; was {node.state})"

    def expire(self, node_id: str, changed_epoch: int) -> str | None:
        """A live node missed its heartbeats: dead (a draining one is removed).

        No-op unless the node is still live with the same changed_epoch the leader saw.
        """
        node = self.map.node(node_id)
        if node is None or node.state not in LIVE_STATES or node.changed_epoch != changed_epoch:
            return None
        if node.state == DRAINING:
            self._drop_node(node_id)
            return f"{node_id} removed (draining node missed its heartbeats)"
        self._set_node(node._replace(state=DEAD))
        return f"{node_id} dead (missed its heartbeats; was {node.state})"

    def activate(self, node_id: str, changed_epoch: int, forced: bool = False) -> str | None:
        """joining -> active once the others rebalanced, or unconditionally when `forced` (timeout)."""
        node = self.map.node(node_id)
        if node is None or node.state != JOINING or node.changed_epoch != changed_epoch:
            return None
        if not forced and not self.ready_to_activate(node_id):
            return None
        self._set_node(node._replace(state=ACTIVE))
        why = "migration timed out" if forced else "every live node rebalanced"
        return f"{node_id} active ({why})"

    def finish_drain(self, node_id: str, changed_epoch: int, forced: bool = False) -> str | None:
        """draining -> removed once it pushed its keys, or unconditionally when `forced` (timeout)."""
        node = self.map.node(node_id)
        if node is None or node.state != DRAINING or node.changed_epoch != changed_epoch:
            return None
        if not forced and not self.drain_finished(node_id):
            return None
        self._drop_node(node_id)
        why = "drain timed out" if forced else "it pushed its keys"
        return f"{node_id} removed ({why})"

    # -- helpers ------------------------------------------------------------

    def _existing(self, node_id: str) -> NodeInfo:
        node = self.map.node(node_id)
        if node is None:
            raise StateError(
                NOT_FOUND, f"no node {node_id!r} in the map (epoch {self.map.epoch}); check the id with Status"
            )
        return node

    def _set_node(self, node: NodeInfo) -> None:
        new_map = self.map.with_node(node)
        if node.state == JOINING:
            # A (re-)joining process has pushed nothing for this map yet.
            self.rebalanced = {**self.rebalanced, node.id: 0}
        elif node.id not in self.rebalanced:
            self.rebalanced = {**self.rebalanced, node.id: 0}
        self.map = new_map

    def _drop_node(self, node_id: str) -> None:
        self.map = self.map.without_node(node_id)
        if node_id in self.rebalanced:
            self.rebalanced = {k: v for k, v in self.rebalanced.items() if k != node_id}
