"""The cluster map: (epoch, nodes[id, address, weight, state], placement), immutable.

The master owns it (Raft-replicated); nodes and clients hold copies and
compute placement from them (gcache.cluster.placement). The epoch rises by one
on every change that any reader could care about, so "newer" is just a larger
epoch. Encoded as a plain dict (msgpack / JSON) by `to_dict` / `from_dict`.

`placement` names how keys map to nodes (gcache.cluster.placement), so every
client, node and master places keys one way for a given map: "ketama" (the
first placement; a map without the field), "rendezvous" (weighted
rendezvous hashing: a change of one node moves keys only to or from it).
A map naming a placement this code does not know is refused (MapError), never
read with another placement.

States:
  joining   registered, owns keys (writes go to it), migration into it running;
            readers fall back to the previous owner on a miss.
  active    owns its share of keys.
  draining  serves reads only; pushes its keys to their next owners, then leaves.
  dead      missed heartbeats; owns nothing and is never contacted.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from gcache.common.address import parse_host_port


class NodeState(enum.StrEnum):
    """A node's state in the map (the docstring above); the values are the wire strings."""

    JOINING = "joining"
    ACTIVE = "active"
    DRAINING = "draining"
    DEAD = "dead"


JOINING, ACTIVE, DRAINING, DEAD = NodeState.JOINING, NodeState.ACTIVE, NodeState.DRAINING, NodeState.DEAD
STATES = tuple(s.value for s in NodeState)  # the strings, in lifecycle order
# A heartbeat's answer is the node's state, or this for a node not in the map.
UNKNOWN = "unknown"
# Owners of new writes and first reads.
WRITE_STATES = (JOINING, ACTIVE)
# Owners before the migration in progress: a miss at the write owner falls back here.
PREVIOUS_STATES = (ACTIVE, DRAINING)

NODE_ID_BYTES_MAX = 128
NODES_MAX = 4096
WEIGHT_MAX = 1 << 20


class PlacementKind(enum.StrEnum):
    """How keys map to nodes; the values are the wire strings of the map's "placement"."""

    KETAMA = "ketama"  # uhashring ketama ring: the placement of maps without the field
    RENDEZVOUS = "rendezvous"  # weighted rendezvous hashing (gcache.cluster.rendezvous)


# What a map without "placement" means (maps written before the field existed).
PLACEMENT_LEGACY = PlacementKind.KETAMA
# What a new cluster's master starts with (an existing map keeps its own).
PLACEMENT_NEW = PlacementKind.RENDEZVOUS


class MapError(ValueError):
    """A cluster map (or a node entry) that breaks the rules above."""


class NodeInfo(NamedTuple):
    id: str
    address: str  # "host:port" of the data server
    weight: int  # >= 1, proportional to capacity (see weight_for_capacity)
    state: str  # a NodeState (a plain str when read by from_dict)
    changed_epoch: int = 0  # epoch at which `state` (or address/weight) last changed
    admin: str = ""  # "host:port" of the node's admin HTTP, "" if none

    def to_dict(self) -> dict:
        """Plain values only (the state as its string), for msgpack, JSON and the Raft dump."""
        return {**self._asdict(), "state": str(self.state)}

    @classmethod
    def from_dict(cls, d: dict) -> NodeInfo:
        try:
            node = cls(
                id=str(d["id"]),
                address=str(d["address"]),
                weight=int(d["weight"]),
                state=str(d["state"]),
                changed_epoch=int(d.get("changed_epoch", 0)),
                admin=str(d.get("admin", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise MapError(f"bad node entry {d!r}: {e}") from None
        node.validate()
        return node

    def validate(self) -> None:
        if not 0 < len(self.id.encode()) <= NODE_ID_BYTES_MAX:
            raise MapError(f"node id must be 1..{NODE_ID_BYTES_MAX} bytes, got {self.id!r}")
        if self.state not in STATES:
            raise MapError(f"node {self.id}: state {self.state!r} is not one of {STATES}")
        if not 1 <= self.weight <= WEIGHT_MAX:
            raise MapError(f"node {self.id}: weight {self.weight} not in [1, {WEIGHT_MAX}]")
        try:
            parse_host_port(self.address)
        except ValueError:
            raise MapError(f"node {self.id}: address {self.address!r} is not host:port") from None


class ClusterMap(NamedTuple):
    epoch: int
    nodes: tuple  # of NodeInfo, sorted by id
    placement: str = PLACEMENT_LEGACY  # a PlacementKind

    @classmethod
    def empty(cls, placement: str = PLACEMENT_LEGACY) -> ClusterMap:
        return cls(0, (), PlacementKind(placement))

    def node(self, node_id: str) -> NodeInfo | None:
        for n in self.nodes:
            if n.id == node_id:
                return n
        return None

    def in_states(self, states) -> list[NodeInfo]:
        return [n for n in self.nodes if n.state in states]

    @property
    def migrating(self) -> bool:
        """True while some node joins or drains: readers may fall back to previous owners."""
        return any(n.state in (JOINING, DRAINING) for n in self.nodes)

    def to_dict(self) -> dict:
        # The legacy placement is written as no field: the bytes older readers expect.
        out = {"epoch": self.epoch, "nodes": [n.to_dict() for n in self.nodes]}
        if self.placement != PLACEMENT_LEGACY:
            out["placement"] = str(self.placement)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> ClusterMap:
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("epoch"), int)
            or not isinstance(d.get("nodes"), (list, tuple))
        ):
            raise MapError(f"a cluster map is {{'epoch': int, 'nodes': [...]}}, got {d!r:.200}")
        if len(d["nodes"]) > NODES_MAX:
            raise MapError(f"map has {len(d['nodes'])} nodes, more than {NODES_MAX}")
        nodes = tuple(sorted((NodeInfo.from_dict(n) for n in d["nodes"]), key=lambda n: n.id))
        if len({n.id for n in nodes}) != len(nodes):
            raise MapError("map lists a node id twice")
        placement = d.get("placement", PLACEMENT_LEGACY)
        try:
            placement = PlacementKind(placement)
        except ValueError:
            raise MapError(
                f"map placement {placement!r} is not one of {[k.value for k in PlacementKind]}: "
                "this gcache is older than the cluster's; upgrade it"
            ) from None
        return cls(d["epoch"], nodes, placement)

    def with_node(self, node: NodeInfo) -> ClusterMap:
        """A map at epoch + 1 where `node` is added or replaces the entry with its id."""
        node = node._replace(changed_epoch=self.epoch + 1)
        node.validate()
        others = [n for n in self.nodes if n.id != node.id]
        return ClusterMap(self.epoch + 1, tuple(sorted(others + [node], key=lambda n: n.id)), self.placement)

    def without_node(self, node_id: str) -> ClusterMap:
        return ClusterMap(self.epoch + 1, tuple(n for n in self.nodes if n.id != node_id), self.placement)


def weight_for_capacity(capacity_bytes: int) -> int:
    """Ring weight from a node's capacity (memory + disk): one unit per GiB, at least 1."""
    return max(1, min(WEIGHT_MAX, capacity_bytes >> 30))
