"""The node's cluster agent: register, heartbeat, apply maps, rebalance (docs/cluster.md).

Two daemon threads:
  heartbeat  registers with the masters (capped backoff while none answers; the
             node keeps serving what it has meanwhile), then heartbeats every
             --heartbeat-interval-s with {node_id, epoch, rebalanced_epoch,
             degraded}. A newer epoch in the answer fetches the map and applies
             it: the native server gets it first (stale writers are refused from
             then on), then the rebalance thread. "unknown" / "dead" answers
             re-register. When a registration (re)adds the node to the map, the
             next rebalance drops unowned keys instead of pushing them; a quick
             restart that finds the node still live pushes them.
  rebalance  runs gcache.server.rebalance for the newest map; a newer map
             aborts the run in progress and starts over. When done,
             rebalanced_epoch = that map's epoch, sent at once in a heartbeat.

A node that was draining and is then missing from the map, with its keys
pushed, calls `on_drained` (main stops the process, exit 0).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgpack

from gcache.cluster.cluster_map import DEAD, DRAINING, JOINING, UNKNOWN, WRITE_STATES, ClusterMap, weight_for_capacity
from gcache.cluster.master_api import MasterClient, MasterUnavailableError
from gcache.server.degradation import DegradationMonitor
from gcache.server.rebalance import RebalanceAborted, RebalanceCounters, Rebalancer, keeps_local_copies
from gcache.wire.auth import placement_key

log = logging.getLogger("gcache.server.cluster")

REGISTER_BACKOFF_MIN_S = 0.2
REGISTER_BACKOFF_MAX_S = 5.0
MASTER_CALL_TIMEOUT_MIN_S = 0.5
MASTER_CALL_TIMEOUT_MAX_S = 2.0
REBALANCE_ATTEMPTS = 3  # per map, after unexpected errors
REBALANCE_RETRY_S = 1.0
INCOMPLETE_RETRY_MIN_S = 0.5  # an owner was unreachable: try the same map again, backing off
INCOMPLETE_RETRY_MAX_S = 5.0
STOP_JOIN_S = 5.0
DEAD_ANSWER = DEAD  # heartbeat answers: the node's state, or UNKNOWN


def _ring_signature(cmap: ClusterMap) -> tuple:
    """What placement depends on: the placement kind, the write ring's members, weights and addresses."""
    return (str(cmap.placement),) + tuple((n.id, n.weight, n.address) for n in cmap.in_states(WRITE_STATES))


def local_address(host: str, port: int) -> str:
    """Where this process reaches its own data port."""
    if host in ("0.0.0.0", ""):
        return f"127.0.0.1:{port}"
    if host in ("::", "[::]"):
        return f"::1:{port}"
    return f"{host}:{port}"


class ClusterAgent:
    """Membership of one node; start() after the native server listens, stop() before it stops."""

    def __init__(
        self,
        settings,
        native,
        *,
        bound_port: int,
        admin_address: str = "",
        stats: Callable[[], dict],
        on_drained: Callable[[], None],
    ):
        self.node_id = settings.node_id_or_default(bound_port)
        self.address = settings.advertise_address(bound_port)
        self.admin_address = admin_address
        self.weight = weight_for_capacity(settings.memory + settings.disk)
        self.interval_s = settings.heartbeat_interval_s
        timeout_s = min(MASTER_CALL_TIMEOUT_MAX_S, max(MASTER_CALL_TIMEOUT_MIN_S, 2 * self.interval_s))
        self.masters = MasterClient(settings.master, timeout_s=timeout_s, credentials=settings.master_credentials())
        self.monitor = DegradationMonitor(stats, settings.data_dir or None, settings.memory_pressure_drain)
        self.counters = RebalanceCounters()
        self._native = native
        self._on_drained = on_drained
        self._rebalancer = Rebalancer(
            self.node_id,
            local_address(settings.host, bound_port),
            list_keys_page=native.keys_page,
            remove_keys=native.remove_keys,
            fence=native.wait_puts_admitted_before,  # PUTs admitted under the old map finish first
            batch_bytes=settings.rebalance_batch_bytes,
            batch_keys=settings.batch_keys_max,
            counters=self.counters,
            token=settings.auth.cluster_token() if settings.auth else None,
            placement_key=placement_key if settings.auth else None,
        )
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._wake = threading.Event()  # heartbeat now (rebalance finished)
        self._map = ClusterMap.empty()  # newest map applied to the native server
        self._pending: ClusterMap | None = None  # newest map the rebalancer has not started
        self._drop_next = False  # (re)entered the map as a new member: drop
        self._drop_generation = 0
        self._last_done: tuple | None = None  # (ring signature, keep) of the last clean run
        self._rebalancing = False
        self._draining_seen = False
        self._drained = False
        self.rebalanced_epoch = 0
        self.registered = False
        self.master_state = ""
        self._last_answer_mono = 0.0
        self._masters_ok = True
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="gcache-heartbeat", daemon=True),
            threading.Thread(target=self._rebalance_loop, name="gcache-rebalance", daemon=True),
        ]

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        log.info(
            "cluster: node %s at %s (weight %d) joining via masters %s",
            self.node_id,
            self.address,
            self.weight,
            ",".join(self.masters.addresses),
        )
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join(STOP_JOIN_S)
        self._rebalancer.close()
        self.masters.close()

    def request_drain(self, reason: str = "") -> dict:
        """POST /drain: ask the master to drain this node (sent with the next heartbeat)."""
        self.monitor.request(reason or "operator: POST /drain")
        self._wake.set()
        return self.status()

    # -- observing ------------------------------------------------------------

    def status(self) -> dict:
        me = self._map.node(self.node_id)
        age = time.monotonic() - self._last_answer_mono if self._last_answer_mono else None
        return {
            "node_id": self.node_id,
            "address": self.address,
            "weight": self.weight,
            "masters": list(self.masters.addresses),
            "registered": self.registered,
            "state": me.state if me else ("removed" if self._draining_seen else "not in map"),
            "epoch": self._map.epoch,
            "rebalanced_epoch": self.rebalanced_epoch,
            "rebalancing": self._rebalancing,
            "degraded": self.monitor.reason,
            "master_answer_age_s": round(age, 3) if age is not None else None,
            "rebalance": self.counters.as_dict(),
        }

    def metrics(self) -> dict:
        """Counters and gauges to merge into the node's stats for /metrics."""
        c = self.counters.as_dict()
        return {
            "counters": {
                "rebalances": c["rebalances"],
                "rebalances_aborted": c["rebalances_aborted"],
                "rebalance_keys_pushed": c["keys_pushed"],
                "rebalance_bytes_pushed": c["bytes_pushed"],
                "rebalance_keys_dropped": c["keys_dropped"],
                "rebalance_push_failures": c["push_failures"],
                "rebalance_push_no_space": c["push_no_space"],
                "rebalance_milliseconds": int(c["seconds"] * 1000),
            },
            "gauges": {
                "cluster_epoch": self._map.epoch,
                "cluster_rebalanced_epoch": self.rebalanced_epoch,
                "cluster_registered": int(self.registered),
                "cluster_rebalancing": int(self._rebalancing),
                "cluster_degraded": int(bool(self.monitor.reason)),
            },
        }

    # -- heartbeat thread ---------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        backoff_s = REGISTER_BACKOFF_MIN_S
        while not self._stop.is_set():
            wait_s = self.interval_s
            try:
                if not self.registered:
                    self._register()
                    backoff_s = REGISTER_BACKOFF_MIN_S
                else:
                    self._heartbeat()
                self._note_masters(None)
            except MasterUnavailableError as e:
                self._note_masters(e)
                if not self.registered:
                    wait_s, backoff_s = backoff_s, min(REGISTER_BACKOFF_MAX_S, backoff_s * 2)
            except Exception as e:  # noqa: BLE001 -- keep heartbeating whatever one answer was
                log.warning("cluster: master call failed: %s", e)
                if not self.registered:
                    wait_s, backoff_s = backoff_s, min(REGISTER_BACKOFF_MAX_S, backoff_s * 2)
            self._wake.wait(wait_s)
            self._wake.clear()

    def _note_masters(self, error: Exception | None) -> None:
        if error is None:
            self._last_answer_mono = time.monotonic()
            if not self._masters_ok:
                log.info("cluster: masters answer again")
            self._masters_ok = True
        elif self._masters_ok:
            self._masters_ok = False
            log.warning("cluster: %s; still serving data, retrying", error)

    def _register(self) -> None:
        answer = self.masters.call(
            "Register",
            {"node_id": self.node_id, "address": self.address, "weight": self.weight, "admin": self.admin_address},
        )
        cmap = ClusterMap.from_dict(answer["map"])
        me = cmap.node(self.node_id)
        if me is not None and me.state == JOINING and me.changed_epoch == cmap.epoch:
            # This registration (re)added the node: it was dead, removed or never here, so
            # keys it holds but does not own may have been removed or replaced meanwhile:
            # drop them. A quick restart (still active in the map) pushes them instead.
            with self._cond:
                self._drop_next = True
                self._drop_generation += 1
        self.registered = True
        self.master_state = answer.get("state", "")
        log.info("cluster: registered as %s, state %s, epoch %d", self.node_id, self.master_state, cmap.epoch)
        self._apply(cmap)

    def _heartbeat(self) -> None:
        answer = self.masters.call(
            "Heartbeat",
            {
                "node_id": self.node_id,
                "epoch": self._map.epoch,
                "rebalanced_epoch": self.rebalanced_epoch,
                "degraded": self.monitor.check(),
            },
        )
        self.master_state = state = answer.get("state", "")
        epoch = int(answer.get("epoch", 0))
        if state in (UNKNOWN, DEAD_ANSWER) and not self._draining_seen:
            log.warning(
                "cluster: the master answers %r for this node: registering again; keys it does not own will be dropped",
                state,
            )
            with self._cond:
                self.registered = False
                self._drop_next = True
                self._drop_generation += 1
            self._wake.set()
            return
        if epoch > self._map.epoch:
            cmap = self.masters.get_map(if_newer_than=self._map.epoch)
            if cmap is not None:
                self._apply(cmap)

    def _apply(self, cmap: ClusterMap) -> None:
        """Native server first (stale writers refused from now on), then the rebalancer."""
        with self._cond:
            if cmap.epoch <= self._map.epoch:
                return
            self._native.set_cluster_map(cmap.epoch, msgpack.packb(cmap.to_dict(), use_bin_type=True))
            old, self._map = self._map, cmap
            me = cmap.node(self.node_id)
            if me is not None and me.state == DRAINING and not self._draining_seen:
                self._draining_seen = True
                log.info(
                    "cluster: this node is draining (epoch %d): pushing its keys to their owners, still serving reads",
                    cmap.epoch,
                )
            log.info(
                "cluster: map epoch %d -> %d: %s",
                old.epoch,
                cmap.epoch,
                ", ".join(f"{n.id}={n.state}" for n in cmap.nodes) or "no nodes",
            )
            if me is None and not self._draining_seen:
                return  # removed while live: the next heartbeat registers again
            if me is not None and me.state == DEAD:
                return  # declared dead while running: re-register first, then drop
            self._pending = cmap
            self._cond.notify_all()

    # -- rebalance thread -----------------------------------------------------------

    def _should_abort(self) -> bool:
        return self._stop.is_set() or self._pending is not None

    def _rebalance_loop(self) -> None:
        attempts: dict[int, int] = {}
        incomplete_wait_s = INCOMPLETE_RETRY_MIN_S
        while not self._stop.is_set():
            with self._cond:
                while self._pending is None and not self._stop.is_set():
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return
                cmap, self._pending = self._pending, None
                if cmap is None:  # cannot happen: the wait above ended with a map pending
                    raise RuntimeError("invariant broken: the wait above ended with a map pending")
                keep = keeps_local_copies(cmap, self.node_id)
                drop = self._drop_next and not keep
                generation = self._drop_generation
                self._rebalancing = True
            try:
                clean, complete = self._rebalance(cmap, drop, keep)
            except RebalanceAborted:
                continue
            except Exception:  # noqa: BLE001 -- log, retry a few times, leave it to the master's timeout
                attempts[cmap.epoch] = attempts.get(cmap.epoch, 0) + 1
                log.exception(
                    "cluster: rebalance for epoch %d failed (attempt %d of %d)",
                    cmap.epoch,
                    attempts[cmap.epoch],
                    REBALANCE_ATTEMPTS,
                )
                with self._cond:
                    if attempts[cmap.epoch] < REBALANCE_ATTEMPTS and self._pending is None:
                        self._pending = cmap
                self._stop.wait(REBALANCE_RETRY_S)
                continue
            finally:
                self._rebalancing = False
            attempts.clear()
            with self._cond:
                if drop and generation == self._drop_generation:
                    self._drop_next = False
                self._last_done = (_ring_signature(cmap), keep) if clean else None
                if not complete:
                    # Some owner could not be reached: the migration is not done, so
                    # rebalanced_epoch stays and the same map runs again (a newer map
                    # replaces it). The master's --migration-timeout-s bounds a drain.
                    if self._pending is None:
                        self._pending = cmap
                    retry_s, incomplete_wait_s = incomplete_wait_s, min(INCOMPLETE_RETRY_MAX_S, incomplete_wait_s * 2)
                    log.warning(
                        "cluster: epoch %d not fully rebalanced (an owner was unreachable); retrying in %.1f s",
                        cmap.epoch,
                        retry_s,
                    )
                else:
                    incomplete_wait_s = INCOMPLETE_RETRY_MIN_S
                    self.rebalanced_epoch = max(self.rebalanced_epoch, cmap.epoch)
            left = cmap.node(self.node_id) is None and self._draining_seen
            if not complete and not left:  # (a node the master removed has nothing left to do)
                with self._cond:  # a newer map (or stop) ends the wait early
                    self._cond.wait_for(lambda: self._stop.is_set() or self._pending is not cmap, retry_s)
                continue
            self._wake.set()  # report rebalanced_epoch now
            if left and not self._drained:
                self._drained = True
                log.info("cluster: drain complete: this node left the map at epoch %d", cmap.epoch)
                self._on_drained()
                return

    def _rebalance(self, cmap: ClusterMap, drop: bool, keep: bool) -> tuple[bool, bool]:
        """Runs (or skips) one rebalance: (clean: every unowned key moved, complete: nothing
        left that a retry could move)."""
        if not drop and self._last_done == (_ring_signature(cmap), keep):
            # Same write ring as the last clean run (e.g. joining -> active): nothing moves.
            log.info("cluster: epoch %d leaves the write ring as it was: nothing to move", cmap.epoch)
            return True, True
        self._last_done = None  # an aborted or failed run must not let a later map skip
        result = self._rebalancer.run(cmap, drop=drop, should_abort=self._should_abort)
        return result.push_failures == 0 and result.push_no_space == 0, result.complete
