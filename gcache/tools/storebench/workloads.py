"""The four timed workloads, written once against the Peer contract.

put      fresh keys every batch (a put of an existing key is a no-op in GCache
         and Mooncake); live data is capped at the working set by untimed removes
get      a working set put and read once (warm), then read in a loop
exists   one batched existence check over `exists_keys` keys, half present
latency  single-key GETs of small values, one at a time

Only the store calls are timed; preparation, warm-up and clean-up are not. Each timed call
also takes the process's CPU time (time.process_time: every thread of the client process,
its copy pool and a peer's own threads included), for the client CPU per call.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gcache.tools.storebench.peers.base import Peer

WORKLOADS = ("put", "get", "exists", "latency")
LATENCY_SAMPLES_MAX = 1_000_000  # per worker; later samples are not kept
PREPARE_BATCH_KEYS_MAX = 1024  # keys per untimed put while preparing
EXISTS_VALUE_BYTES = 64  # values behind the `exists` keys
BARRIER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class WorkloadConfig:
    value_size: int = 256 << 10
    batch: int = 64
    duration_s: float = 10.0
    ops_max: int | None = None  # stop after this many timed calls (per worker)
    exists_keys: int = 10_000
    working_set_bytes: int = 256 << 20  # live bytes per worker in put and get
    warm_bytes: int = 0  # extra untimed put/remove traffic first (0 = working set)
    latency_value_size: int = 4096
    latency_keys: int = 256


@dataclass
class WorkerResult:
    """What one worker measured in one timed loop."""

    calls: int = 0
    keys: int = 0
    bytes: int = 0
    seconds: float = 0.0  # time spent inside timed store calls
    cpu_seconds: float = 0.0  # this process's CPU time (all its threads) across the timed calls
    misses: int = 0  # keys not found / not stored / wrong answer
    verified: bool = True  # bytes read back equal the bytes put
    latencies_s: list[float] = field(default_factory=list)

    def record(self, elapsed_s: float, cpu_s: float = 0.0) -> None:
        self.calls += 1
        self.seconds += elapsed_s
        self.cpu_seconds += cpu_s
        if len(self.latencies_s) < LATENCY_SAMPLES_MAX:
            self.latencies_s.append(elapsed_s)


class Barrier(Protocol):
    """What a worker uses of a threading or multiprocessing Barrier."""

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class WorkerContext:
    worker_id: int
    key_prefix: str  # unique per run, worker and workload
    barrier: Barrier  # threading/multiprocessing Barrier
    on_tick: Callable[[], None] = lambda: None

    def with_prefix(self, suffix: str) -> WorkerContext:
        return WorkerContext(self.worker_id, f"{self.key_prefix}/{suffix}", self.barrier, self.on_tick)

    def key_stream(self, start: int = 0):
        seq = start
        while True:
            yield f"{self.key_prefix}/{seq}"
            seq += 1


def _done(result: WorkerResult, cfg: WorkloadConfig) -> bool:
    if cfg.ops_max is not None and result.calls >= cfg.ops_max:
        return True
    return result.seconds >= cfg.duration_s


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _take(stream, n: int) -> list[str]:
    return [next(stream) for _ in range(n)]


def _put_untimed(peer: Peer, keys: list[str], buf: np.ndarray, size: int) -> int:
    """Puts keys in chunks that fit `buf`; values repeat the buffer's slots."""
    per_call = min(len(buf) // size, PREPARE_BATCH_KEYS_MAX)
    stored = 0
    for i in range(0, len(keys), per_call):
        stored += peer.put_from(keys[i : i + per_call], buf, size)
    return stored


def _warm(peer: Peer, cfg: WorkloadConfig, ctx: WorkerContext, buf: np.ndarray) -> None:
    """Untimed put/get/remove traffic so first-touch costs (page faults, segments) are paid."""
    per_batch = cfg.batch * cfg.value_size
    rounds = max(2, (cfg.warm_bytes or cfg.working_set_bytes) // per_batch)
    stream = ctx.key_stream()
    live: deque[list[str]] = deque()
    for _ in range(rounds):
        keys = _take(stream, cfg.batch)
        peer.put_from(keys, buf, cfg.value_size)
        live.append(keys)
        while len(live) * per_batch > cfg.working_set_bytes:
            peer.remove(live.popleft())
        ctx.on_tick()
    for keys in live:
        peer.get_into(keys, buf, cfg.value_size)  # reading into buf rewrites the same bytes
        peer.remove(keys)


def run_put(peer: Peer, cfg: WorkloadConfig, ctx: WorkerContext) -> WorkerResult:
    buf = _pattern(cfg.batch * cfg.value_size, ctx.worker_id)
    peer.prepare_buffer(buf)
    _warm(peer, cfg, ctx.with_prefix("warm"), buf)
    per_batch = cfg.batch * cfg.value_size
    stream = ctx.key_stream()
    live: deque[list[str]] = deque()
    result = WorkerResult()
    ctx.barrier.wait(BARRIER_TIMEOUT_S)
    while not _done(result, cfg):
        keys = _take(stream, cfg.batch)
        cpu, start = time.process_time(), time.perf_counter()
        stored = peer.put_from(keys, buf, cfg.value_size)
        result.record(time.perf_counter() - start, time.process_time() - cpu)
        result.keys += cfg.batch
        result.bytes += stored * cfg.value_size
        result.misses += cfg.batch - stored
        live.append(keys)
        while len(live) * per_batch > cfg.working_set_bytes:
            peer.remove(live.popleft())  # untimed: bounds each store's live data
        ctx.on_tick()
    for keys in live:
        peer.remove(keys)
    return result


def run_get(peer: Peer, cfg: WorkloadConfig, ctx: WorkerContext) -> WorkerResult:
    src = _pattern(cfg.batch * cfg.value_size, ctx.worker_id + 1000)
    out = np.zeros_like(src)
    peer.prepare_buffer(src)
    peer.prepare_buffer(out)
    _warm(peer, cfg, ctx.with_prefix("warm"), out)
    batches = max(1, cfg.working_set_bytes // (cfg.batch * cfg.value_size))
    stream = ctx.key_stream()
    working_set = [_take(stream, cfg.batch) for _ in range(batches)]
    result = WorkerResult()
    for keys in working_set:
        stored = peer.put_from(keys, src, cfg.value_size)
        result.verified &= stored == cfg.batch
    for keys in working_set:  # warm read, checked byte for byte
        out.fill(0)
        hits = peer.get_into(keys, out, cfg.value_size)
        result.verified &= hits == cfg.batch and bool(np.array_equal(out, src))
    ctx.barrier.wait(BARRIER_TIMEOUT_S)
    i = 0
    while not _done(result, cfg):
        keys = working_set[i % batches]
        i += 1
        cpu, start = time.process_time(), time.perf_counter()
        hits = peer.get_into(keys, out, cfg.value_size)
        result.record(time.perf_counter() - start, time.process_time() - cpu)
        result.keys += cfg.batch
        result.bytes += hits * cfg.value_size
        result.misses += cfg.batch - hits
        ctx.on_tick()
    result.verified &= bool(np.array_equal(out, src))
    for keys in working_set:
        peer.remove(keys)
    return result


def run_exists(peer: Peer, cfg: WorkloadConfig, ctx: WorkerContext) -> WorkerResult:
    present = cfg.exists_keys // 2
    stream = ctx.key_stream()
    present_keys = _take(stream, present)
    missing_keys = [f"{ctx.key_prefix}/missing/{i}" for i in range(cfg.exists_keys - present)]
    keys = [k for pair in zip(present_keys, missing_keys) for k in pair]
    keys += missing_keys[len(present_keys) :]  # odd counts
    small = _pattern(PREPARE_BATCH_KEYS_MAX * EXISTS_VALUE_BYTES, ctx.worker_id + 2000)
    peer.prepare_buffer(small)
    result = WorkerResult()
    result.verified = _put_untimed(peer, present_keys, small, EXISTS_VALUE_BYTES) == present
    result.verified &= peer.exists(keys) == present  # warm call
    ctx.barrier.wait(BARRIER_TIMEOUT_S)
    while not _done(result, cfg):
        cpu, start = time.process_time(), time.perf_counter()
        found = peer.exists(keys)
        result.record(time.perf_counter() - start, time.process_time() - cpu)
        result.keys += len(keys)
        result.misses += found != present
        ctx.on_tick()
    for i in range(0, present, PREPARE_BATCH_KEYS_MAX):
        peer.remove(present_keys[i : i + PREPARE_BATCH_KEYS_MAX])
    return result


def run_latency(peer: Peer, cfg: WorkloadConfig, ctx: WorkerContext) -> WorkerResult:
    size = cfg.latency_value_size
    src = _pattern(min(cfg.latency_keys, PREPARE_BATCH_KEYS_MAX) * size, ctx.worker_id + 3000)
    peer.prepare_buffer(src)
    stream = ctx.key_stream()
    keys = _take(stream, cfg.latency_keys)
    result = WorkerResult()
    result.verified = _put_untimed(peer, keys, src, size) == len(keys)
    slots = len(src) // size
    for i, key in enumerate(keys):  # warm read, checked byte for byte
        value = peer.get_one(key)
        slot = i % slots
        result.verified &= value is not None and value == src[slot * size : (slot + 1) * size].tobytes()
    ctx.barrier.wait(BARRIER_TIMEOUT_S)
    i = 0
    while not _done(result, cfg):
        key = keys[i % len(keys)]
        i += 1
        cpu, start = time.process_time(), time.perf_counter()
        value = peer.get_one(key)
        result.record(time.perf_counter() - start, time.process_time() - cpu)
        result.keys += 1
        if value is None or len(value) != size:
            result.misses += 1
        else:
            result.bytes += size
        ctx.on_tick()
    peer.remove(keys)
    return result


RUNNERS = {"put": run_put, "get": run_get, "exists": run_exists, "latency": run_latency}
