"""Keeps the newest cluster map a client has seen.

Maps come from the masters (once at start, then every `refresh_s` and whenever
a caller asks, on a daemon thread so no caller ever waits on a master) and from
nodes (the map in a STALE_EPOCH answer, handed to `offer`). Epochs only grow:
a map is adopted only if its epoch is larger than the current one. With every
master down the current map stays in use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from gcache.cluster.cluster_map import ClusterMap, MapError
from gcache.cluster.master_api import MasterClient, MasterUnavailableError

log = logging.getLogger(__name__)

# Refreshes asked for by many failing calls at once are merged: at most one
# master round trip per this many seconds.
REFRESH_GAP_S_MIN = 0.1
THREAD_JOIN_S = 1.0


class MapSource:
    """The current map, and the thread that keeps it fresh.

    on_change(new_map) runs (serialized, in epoch order) before `current`
    returns the new map, so whatever the owner derives from a map (placement,
    per-node clients) is ready by the time callers see it.
    """

    def __init__(
        self,
        masters: list[str] | None,
        on_change: Callable[[ClusterMap], None],
        *,
        initial_map: ClusterMap | None = None,
        refresh_s: float = 2.0,
        master_timeout_s: float = 2.0,
        credentials=None,
    ):
        self._on_change = on_change
        self.refresh_s = refresh_s
        self._cond = threading.Condition(threading.Lock())
        self._adopt_lock = threading.Lock()  # serializes on_change calls
        self._map = ClusterMap.empty()
        self._master = MasterClient(masters, master_timeout_s, credentials) if masters else None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self.refreshes = 0  # master answers received
        self.adoptions = 0  # newer maps adopted, from any source
        if initial_map is None:
            if self._master is None:
                raise ValueError("MapSource needs masters or an initial_map")
            try:
                first = self._master.get_map()
            except MasterUnavailableError as exc:
                self._master.close()
                raise MasterUnavailableError(
                    f"{exc}; or pass initial_map=ClusterMap(...) to start without a master"
                ) from None
            if first is None:
                first = ClusterMap.empty()
            self.refreshes += 1
            initial_map = first
        self._adopt(initial_map, force=True)
        self._thread = None
        if self._master is not None:
            self._thread = threading.Thread(target=self._refresh_loop, name="gcache-map-refresh", daemon=True)
            self._thread.start()

    @property
    def current(self) -> ClusterMap:
        return self._map

    @property
    def masters(self) -> list[str]:
        return list(self._master.addresses) if self._master is not None else []

    def offer(self, cmap: ClusterMap) -> bool:
        """Adopts `cmap` if it is newer than the current map; True if it was."""
        return self._adopt(cmap, force=False)

    def _adopt(self, cmap: ClusterMap, force: bool) -> bool:
        with self._adopt_lock:
            if not force and cmap.epoch <= self._map.epoch:
                return False
            self._on_change(cmap)
            with self._cond:
                self._map = cmap
                self.adoptions += 0 if force else 1
                self._cond.notify_all()
        return True

    def request_refresh(self) -> None:
        """Asks the thread to fetch a map from the masters now; never waits."""
        self._wake.set()

    def wait_for_epoch(self, epoch_min: int, timeout_s: float) -> bool:
        """Asks for a refresh and waits up to `timeout_s` for a map of epoch >= epoch_min."""
        if self._map.epoch >= epoch_min:
            return True
        if self._master is None or timeout_s <= 0:
            return False
        self.request_refresh()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._map.epoch < epoch_min:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped.is_set():
                    return False
                self._cond.wait(left)
        return True

    def _refresh_loop(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self.refresh_s)
            self._wake.clear()
            if self._stopped.is_set():
                break
            try:
                self.refresh_once()
            except Exception:  # never let the refresher die: callers rely on it
                log.exception("cluster map refresh failed unexpectedly")
            self._stopped.wait(REFRESH_GAP_S_MIN)

    def refresh_once(self) -> bool:
        """One GetMap from the masters; True if it brought a newer map."""
        if self._master is None:
            return False
        try:
            cmap = self._master.get_map(if_newer_than=self._map.epoch)
        except (MasterUnavailableError, grpc.RpcError, MapError, ValueError) as exc:
            # Masters down or partitioned: keep the map we have, try again later.
            log.debug("cluster map refresh failed: %s", exc)
            return False
        self.refreshes += 1
        return cmap is not None and self.offer(cmap)

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(THREAD_JOIN_S)  # a master call in flight may outlast this; it is a daemon
        if self._master is not None:
            self._master.close()
