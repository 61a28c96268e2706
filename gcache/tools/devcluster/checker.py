"""A seeded fault checker for a local GCache cluster.

Concurrent client threads write content-addressed values (each value is
derived from its key, so any value read can be verified) and read them back,
while a fault schedule drawn from the seed runs against the cluster: kill -9
the master leader, kill -9 a node, SIGSTOP a node, partition a node (its
network namespace's link down when the cluster runs with netns=True, else
SIGSTOP: loopback addresses share one network namespace), drain a node, join
a node. It checks three things:

  1. every get returns the exact value or a miss, never wrong bytes;
  2. no client call blocks past its bound (the client's timeout budget);
  3. once the faults settle, the cluster serves again: fresh keys are stored
     and read back exactly, and the map has every node active.

The same seed gives the same fault order, victims and client operations, so
a failing run can be replayed (thread timing still varies).
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from gcache.client.cluster_client import STALE_EPOCH_RETRIES_MAX
from gcache.cluster.cluster_map import ACTIVE, DEAD

FAULTS = ("kill_leader", "kill_node", "stop_node", "partition_node", "drain", "join")
VALUE_BYTES_MIN, VALUE_BYTES_MAX = 256, 16 * 1024
BATCH_KEYS_MAX = 16
CLIENT_TIMEOUT_S = 1.0
CLIENT_RETRIES = 1
# The client's budget: one node timeout for the first try and one per stale-map
# re-split (a node that failed is skipped after that), plus 1 s of scheduling
# slack on a loaded 2-core machine.
CALL_BOUND_S = CLIENT_TIMEOUT_S * (1 + STALE_EPOCH_RETRIES_MAX) + 1.0
VIOLATIONS_KEPT_MAX = 50


def key_for(seed: int, index: int) -> bytes:
    return f"chk/{seed}/{index:08d}".encode()


def value_for(key: bytes) -> bytes:
    """The one value `key` may ever have: its size and bytes both come from the key's hash."""
    digest = hashlib.blake2b(key, digest_size=16).digest()
    size = VALUE_BYTES_MIN + int.from_bytes(digest[:4], "little") % (VALUE_BYTES_MAX - VALUE_BYTES_MIN)
    return np.random.default_rng(int.from_bytes(digest[4:12], "little")).bytes(size)


@dataclass
class Tally:
    """Counters of one client thread (merged at the end); lists are bounded."""

    calls: int = 0
    puts: int = 0
    puts_stored: int = 0
    gets: int = 0
    hits: int = 0
    exceptions: int = 0
    slowest_call_s: float = 0.0
    violations: list = field(default_factory=list)

    def violate(self, what: str) -> None:
        if len(self.violations) < VIOLATIONS_KEPT_MAX:
            self.violations.append(what)

    def merge(self, other: Tally) -> None:
        for name in ("calls", "puts", "puts_stored", "gets", "hits", "exceptions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.slowest_call_s = max(self.slowest_call_s, other.slowest_call_s)
        self.violations.extend(other.violations[: VIOLATIONS_KEPT_MAX - len(self.violations)])


class ClientWorker(threading.Thread):
    """One client thread: seeded random puts, gets and exists over a shared key space."""

    def __init__(self, client, seed: int, worker: int, keys_max: int, stop: threading.Event):
        super().__init__(name=f"checker-{worker}", daemon=True)
        self.client, self.seed, self.keys_max, self.stop_event = client, seed, keys_max, stop
        self.rng = random.Random(seed * 1000 + worker)
        self.tally = Tally()

    def _timed(self, what: str, fn, *args):
        started = time.monotonic()
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 -- a dead peer must never surface as an exception
            self.tally.exceptions += 1
            self.tally.violate(f"{what} raised {type(e).__name__}: {e}")
            return None
        finally:
            took = time.monotonic() - started
            self.tally.calls += 1
            self.tally.slowest_call_s = max(self.tally.slowest_call_s, took)
            if took > CALL_BOUND_S:
                self.tally.violate(f"{what} blocked {took:.2f}s (bound {CALL_BOUND_S:.1f}s)")

    def run(self) -> None:
        while not self.stop_event.is_set():
            n = self.rng.randint(1, BATCH_KEYS_MAX)
            keys = [key_for(self.seed, self.rng.randrange(self.keys_max)) for _ in range(n)]
            op = self.rng.random()
            if op < 0.35:
                stored = self._timed("put_batch", self.client.put_batch, keys, [value_for(k) for k in keys])
                if stored is not None:
                    self.tally.puts += n
                    self.tally.puts_stored += sum(bool(s) for s in stored)
            elif op < 0.9:
                values = self._timed("get_batch", self.client.get_batch, keys)
                if values is not None:
                    self._verify(keys, values)
            else:
                self._timed("batch_is_exist", self.client.batch_is_exist, keys)

    def _verify(self, keys, values) -> None:
        for k, v in zip(keys, values):
            self.tally.gets += 1
            if v is None:
                continue
            self.tally.hits += 1
            if bytes(v) != value_for(k):
                self.tally.violate(f"WRONG BYTES for {k!r}: {len(v)} bytes read")


class FaultRunner:
    """Applies one fault at a time to a LocalCluster, heals it, and times what matters."""

    def __init__(self, cluster, rng: random.Random, hold_s: float, log):
        self.cluster, self.rng, self.hold_s, self.log = cluster, rng, hold_s, log
        self.timings: dict[str, list[float]] = {}
        self.settle_timeout_s = 60.0

    def _time(self, name: str, seconds: float) -> None:
        self.timings.setdefault(name, []).append(round(seconds, 3))

    def _live_node(self):
        cmap = self.cluster.current_map()
        candidates = [
            n for n in self.cluster.nodes if n.alive() and (e := cmap.node(n.id)) is not None and e.state == ACTIVE
        ]
        if len(candidates) < 2:
            return None  # keep at least one node serving
        return self.rng.choice(sorted(candidates, key=lambda m: m.id))

    def _wait_state(self, node_id: str, predicate, what: str):
        return self.cluster.wait_map(lambda m: predicate(m.node(node_id)), self.settle_timeout_s, what)

    def apply(self, fault: str) -> None:
        getattr(self, fault)()

    def kill_leader(self) -> None:
        leader = self.cluster.wait_leader()
        started = time.monotonic()
        self.cluster.kill(leader)
        self.log(f"fault kill_leader: kill -9 {leader.id}")
        self.cluster.wait_leader()
        self._time("leader_takeover_s", time.monotonic() - started)
        time.sleep(self.hold_s)
        self.cluster.start(leader)

    def _lose_node(self, fault: str, sig: int | None) -> None:
        """Loses a node by `sig`, or by a network partition when sig is None; then heals it."""
        node = self._live_node()
        if node is None:
            return
        started = time.monotonic()
        if sig is None:
            self.cluster.partition(node)
            self.log(f"fault {fault}: netns partition of {node.id} (link down in {node.netns})")
        else:
            node.send(sig)
            self.log(f"fault {fault}: {signal.Signals(sig).name} {node.id}")
        try:
            self._wait_state(node.id, lambda n: n is not None and n.state == DEAD, f"{node.id} marked dead")
            self._time("dead_marked_s", time.monotonic() - started)
            time.sleep(self.hold_s)
        finally:  # heal even when the wait failed, so the run goes on with every node
            if sig is None:
                self.cluster.heal(node)
            elif sig == signal.SIGKILL:
                self.cluster.kill(node)  # reap it
                self.cluster.start(node)
            else:
                node.send(signal.SIGCONT)
        started = time.monotonic()
        self.cluster.wait_active([node.id], self.settle_timeout_s)
        self._time("rejoin_active_s", time.monotonic() - started)

    def kill_node(self) -> None:
        self._lose_node("kill_node", signal.SIGKILL)

    def stop_node(self) -> None:
        self._lose_node("stop_node", signal.SIGSTOP)

    def partition_node(self) -> None:
        if getattr(self.cluster, "netns_mode", False):
            self._lose_node("partition_node", None)
            return
        # Every process shares the loopback namespace here, so a partition is
        # simulated by SIGSTOP: the node neither sends nor answers.
        self.log("fault partition_node: no network namespaces (cluster not in netns mode), using SIGSTOP instead")
        self._lose_node("partition_node", signal.SIGSTOP)

    def drain(self) -> None:
        node = self._live_node()
        if node is None:
            return
        started = time.monotonic()
        self.cluster.master_client().call("Drain", {"node_id": node.id})
        self.log(f"fault drain: {node.id}")
        self._wait_state(node.id, lambda n: n is None, f"{node.id} drained and removed")
        self._time("drain_s", time.monotonic() - started)
        self.cluster.stop(node)  # it exits by itself once removed; reap it

    def join(self) -> None:
        started = time.monotonic()
        node = self.cluster.add_node(self.settle_timeout_s)
        self.log(f"fault join: {node.id} at {node.address}")
        self._time("join_active_s", time.monotonic() - started)


def settle_and_verify(cluster, client, seed: int, keys_n: int, timeout_s: float) -> list[str]:
    """After the faults: every live node active, then fresh keys round-trip exactly."""
    problems = []
    live = [n.id for n in cluster.nodes if n.alive()]
    try:
        cluster.wait_map(
            lambda m: not m.migrating and all((e := m.node(i)) is not None and e.state == ACTIVE for i in live),
            timeout_s,
            "settled map",
        )
    except TimeoutError as e:
        return [f"cluster did not settle: {e}"]
    deadline = time.monotonic() + timeout_s
    keys = [f"chk/{seed}/settle/{i}".encode() for i in range(keys_n)]
    while True:  # clients may need a map refresh after the last change
        stored = client.put_batch(keys, [value_for(k) for k in keys])
        if all(stored) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not all(stored):
        problems.append(f"after settling, {stored.count(False)} of {keys_n} fresh puts were refused")
    for k, v in zip(keys, client.get_batch(keys)):
        if v is None or bytes(v) != value_for(k):
            problems.append(f"after settling, {k!r} read back {'a miss' if v is None else 'WRONG BYTES'}")
            break
    return problems


def run_checker(
    cluster,
    *,
    seed: int,
    faults=FAULTS,
    threads: int = 4,
    keys_max: int = 2000,
    hold_s: float = 1.0,
    warmup_s: float = 1.0,
    log=print,
) -> dict:
    """Runs client threads against `cluster` while the seeded faults run; returns the report."""
    from gcache.client.cluster_client import ClusterClient

    rng = random.Random(seed)
    schedule = list(faults)
    rng.shuffle(schedule)
    log(f"checker seed {seed}: faults in order {schedule}")
    client = ClusterClient(
        cluster.client_url,
        timeout_s=CLIENT_TIMEOUT_S,
        retries=CLIENT_RETRIES,
        map_refresh_s=0.5,
        suspect_s=1.0,
        **cluster.client_kwargs,
    )
    stop = threading.Event()
    workers = [ClientWorker(client, seed, i, keys_max, stop) for i in range(threads)]
    runner = FaultRunner(cluster, rng, hold_s, log)
    started = time.monotonic()
    fault_errors = []
    try:
        for w in workers:
            w.start()
        time.sleep(warmup_s)
        for fault in schedule:
            try:
                runner.apply(fault)
            except (TimeoutError, RuntimeError) as e:
                fault_errors.append(f"{fault}: {e}")
                log(f"fault {fault} did not complete: {e}")
        time.sleep(warmup_s)
    finally:
        stop.set()
        for w in workers:
            w.join(CALL_BOUND_S * 2)
    tally = Tally()
    for w in workers:
        if w.is_alive():
            tally.violate(f"{w.name} still blocked {CALL_BOUND_S * 2:.0f}s after the stop")
        tally.merge(w.tally)
    settle_problems = settle_and_verify(cluster, client, seed, 200, 60.0)
    client_stats = client.client_stats()
    client.close()
    return {
        "seed": seed,
        "faults": schedule,
        "seconds": round(time.monotonic() - started, 1),
        "calls": tally.calls,
        "gets": tally.gets,
        "hits": tally.hits,
        "hit_rate": round(tally.hits / tally.gets, 4) if tally.gets else None,
        "puts": tally.puts,
        "puts_stored": tally.puts_stored,
        "exceptions": tally.exceptions,
        "slowest_call_s": round(tally.slowest_call_s, 3),
        "call_bound_s": CALL_BOUND_S,
        "violations": tally.violations,
        "fault_errors": fault_errors,
        "settle_problems": settle_problems,
        "timings": runner.timings,
        "client": client_stats,
        "ok": not tally.violations and not settle_problems and not fault_errors,
    }


def add_checker_arguments(p) -> None:
    p.add_argument("--seed", type=int, default=1, help="replays a run exactly (default 1)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list from {','.join(FAULTS)}")
    p.add_argument("--threads", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--keys", type=int, default=2000, help="key space size (default 2000)")
    p.add_argument("--hold-s", type=float, default=1.0, help="how long each fault lasts (default 1)")


def run_checker_cli(cluster, args) -> int:
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {','.join(FAULTS)}")
    report = run_checker(
        cluster, seed=args.seed, faults=faults, threads=args.threads, keys_max=args.keys, hold_s=args.hold_s
    )
    print(json.dumps(report, indent=2))
    if not report["ok"]:
        print(
            f"CHECK FAILED; replay with: gcache-cluster check --dir {cluster.dir} --seed {args.seed} "
            f"--faults {args.faults}"
        )
    return 0 if report["ok"] else 1
