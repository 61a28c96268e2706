"""The cluster client's per-node single-node Clients, and which nodes are suspect.

A node's Client is created on first use (from its id and address in the map)
and closed once the node leaves the map, dies, or moves to another address.
A node that failed a request is *suspect* for `suspect_s`: the cluster client
skips it (its keys are misses) instead of waiting on it again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import cast

from gcache import errors
from gcache.client.client import ServerClient
from gcache.cluster.cluster_map import DEAD, ClusterMap, NodeInfo
from gcache.common.breaker import Breaker


class NodeClient(ServerClient):
    """A single-node client whose epoch can be set per calling thread.

    Parts of different batches run on one NodeClient at once, each routed by the
    map its caller saw; `using_epoch` makes every request a thread sends carry
    that map's epoch, so a request is never routed by one map but stamped with
    another. Outside `using_epoch` the epoch is the one set by `client.epoch = `.
    The single-node Client keeps its epoch in `_epoch` (behind the validating
    `epoch` property) and reads it once per call; overriding that attribute
    covers both.
    """

    def __init__(self, address: str, **kwargs):
        self._epoch_by_thread = threading.local()
        self._epoch_default = None
        super().__init__(address, **kwargs)

    @property
    def _epoch(self):
        return getattr(self._epoch_by_thread, "epoch", self._epoch_default)

    @_epoch.setter
    def _epoch(self, value) -> None:
        self._epoch_default = value

    @contextmanager
    def using_epoch(self, epoch: int):
        self._epoch_by_thread.epoch = epoch
        try:
            yield self
        finally:
            del self._epoch_by_thread.epoch


class NodeSet:
    """Thread-safe map of node id -> NodeClient, plus which nodes are suspect (a Breaker
    keyed by node id)."""

    def __init__(self, make_client: Callable[[str], NodeClient], suspect_s: float):
        self._make_client = make_client
        self._lock = threading.Lock()
        self._clients: dict[str, NodeClient] = {}
        self._breaker = Breaker(suspect_s)
        self._closed = False

    @property
    def suspect_s(self) -> float:
        return self._breaker.suspect_s

    def client(self, node: NodeInfo) -> NodeClient:
        """The Client of `node` at its current address (created on first use)."""
        stale = None
        with self._lock:
            current = self._clients.get(node.id)
            if current is not None and current.address == node.address:
                return current
            if self._closed:
                raise errors.ClientClosedError("this gcache ClusterClient was closed; create a new one")
            stale = current  # the node moved: its old connections lead nowhere
            current = self._clients[node.id] = self._make_client(node.address)
        if stale is not None:
            stale.close()
        return current

    def existing(self, node: NodeInfo) -> NodeClient | None:
        """The Client of `node` at its current address if one is open; never creates one."""
        with self._lock:
            current = self._clients.get(node.id)
        return current if current is not None and current.address == node.address else None

    def sync(self, cmap: ClusterMap) -> None:
        """Closes the Clients of nodes that left `cmap`, died, or changed address."""
        live = {n.id: n.address for n in cmap.nodes if n.state != DEAD}
        with self._lock:
            gone = [nid for nid, c in self._clients.items() if live.get(nid) != c.address]
            closing = [self._clients.pop(nid) for nid in gone]
        self._breaker.retain(live)
        for c in closing:
            c.close()

    def mark_suspect(self, node_id: str) -> None:
        self._breaker.fail(node_id)

    def is_suspect(self, node_id: str) -> bool:
        return self._breaker.is_suspect(node_id)

    def suspects(self) -> list[str]:
        return cast("list[str]", self._breaker.suspects())  # keyed by node id

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
