"""Measurements bench/hicache/hierarchy.py makes besides the workload runs:

measure_timing   host -> device bandwidth (one large numpy copy) and the L3 server's
                 loopback GET throughput and round trip, for the simulated charges;
density          "cached prefix tokens held per KV byte", per tier, of the checkpointed
                 hierarchy and the SWA-unaware one, on long (8K+ token) conversations.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import gcache
from bench.hicache.cluster import Budgets, Setup, simulate
from bench.hicache.sim import Timing
from bench.hicache.workloads import Turn, long_context_turns
from gcache.common.attention import AttentionKind
from gcache.serving.swa_window import last_safe_end
from gcache.tools.devcluster.local_server import LocalServer
from gcache.wire.keys import page_hashes_array
from gcache.worker.config import ModelConfig
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.kvcache.kv_pool import DualKVCache


def start_server(memory_bytes: int, disk_bytes: int) -> tuple[LocalServer, Path]:
    """A fresh gcache-server: --memory is the L3 budget, --disk a small extra tier."""
    root = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    seg = max(1 << 20, min(64 << 20, disk_bytes // 4))
    srv = LocalServer(
        root / "data", memory=str(memory_bytes), disk=str(disk_bytes), extra_args=["--segment-bytes", str(seg)]
    ).start()
    return srv, root


def stop_server(srv: LocalServer, root: Path) -> None:
    srv.kill()
    shutil.rmtree(root, ignore_errors=True)


def measure_h2d(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes/s of one large numpy copy (the host -> device copy when both are host RAM)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure_l3(address: str, cfg: ModelConfig, repeats: int = 15) -> tuple[float, float]:
    """(GET bytes/s, round trip s) against a gcache-server: batch_get_into of a prefetch-
    shaped batch (128 full pages + 9 SWA pages, the window tail) into one buffer, and a
    one-key exists. Medians. The keys are removed afterwards."""
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    sizes = [bf] * 128 + [bs] * 9
    keys = [f"hicache-bench-probe/{i}" for i in range(len(sizes))]
    offsets = [int(x) for x in np.cumsum([0] + sizes[:-1])]
    buf = np.random.default_rng(0).integers(0, 255, sum(sizes), dtype=np.uint8)
    out = np.zeros_like(buf)
    with gcache.Client(address) as c:
        c.register_buffer(buf)
        c.register_buffer(out)
        assert all(c.batch_put_from(keys, [buf] * len(keys), sizes=sizes, offsets=offsets))
        gets, rtts = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = c.batch_get_into(keys, [out] * len(keys), sizes=sizes, offsets=offsets)
            gets.append(time.perf_counter() - t0)
            assert list(got) == sizes
        assert np.array_equal(out, buf)
        for _ in range(10 * repeats):
            t0 = time.perf_counter()
            c.batch_is_exist(keys[:1])
            rtts.append(time.perf_counter() - t0)
        c.batch_remove(keys)
    return sum(sizes) / float(np.median(gets)), float(np.median(rtts))


def measure_timing(cfg: ModelConfig, memory_bytes: int, disk_bytes: int) -> Timing:
    srv, root = start_server(memory_bytes, disk_bytes)
    try:
        bw, rtt = measure_l3(srv.address, cfg)
    finally:
        stop_server(srv, root)
    return Timing(h2d_bytes_per_s=measure_h2d(), l3_bytes_per_s=bw, l3_rtt_s=rtt)


# ---- density ---------------------------------------------------------------------------
def _final_sequences(turns: list[Turn]) -> list[np.ndarray]:
    """Each conversation's last turn, as computed (every earlier turn is a prefix of it)."""
    continued = {t.after for t in turns}
    return [t.computed() for i, t in enumerate(turns) if i not in continued]


def _tier_holdings(w, seqs: list[np.ndarray], cfg: ModelConfig) -> dict:
    """Per tier: (prefix tokens loadable from that tier alone, summed over the
    conversations' final sequences; KV bytes the tier holds)."""
    ps, W = cfg.page_size, cfg.window
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    cache = w.cache
    out = {}
    # spare SWA pages (kept only while the pool has room, evicted first) are not part of the
    # checkpointed footprint this measures: count L1 as it stands once they are needed
    cache.tree.evict(0, cache.tree.spare_pages())
    f, s = cache.tree.cached_pages()
    l1 = sum(cache.tree.match(q, max_len=len(q) // ps * ps).prefix_len for q in seqs)
    out["L1"] = (l1, f * bf + s * bs)
    f, s = cache.host.used_pages()
    l2 = l3 = 0
    for q in seqs:
        keys = page_hashes_array(q[: len(q) // ps * ps], ps)
        n, swa = cache.host.run(keys, 0)
        l2 += last_safe_end(0, n, lambda i: swa[i], ps, W) * ps
        kb = cache.l3.keys
        n3 = w.client.batch_exists_prefix([kb.key(h, AttentionKind.FULL) for h in keys])
        swa3 = w.client.batch_is_exist([kb.key(h, AttentionKind.SWA) for h in keys[:n3]])
        l3 += last_safe_end(0, n3, lambda i: swa3[i], ps, W) * ps
    out["L2"] = (l2, f * bf + s * bs)
    out["L3"] = (l3, len(w.client.keys["full"]) * bf + len(w.client.keys["swa"]) * bs)
    return out


def density(cfg: ModelConfig, cost, timing: Timing, seed: int, conversations: int, sched: SchedulerConfig) -> dict:
    """Runs a few 8-16K-token conversations through one worker per hierarchy (ours, and
    SWA-unaware) with budgets large enough that nothing is evicted, then measures each
    tier: prefix tokens a request could load from it alone / KV bytes it holds."""
    turns = long_context_turns(seed, conversations)
    seqs = _final_sequences(turns)
    bf, bs = DualKVCache.page_bytes(cfg, AttentionKind.FULL), DualKVCache.page_bytes(cfg, AttentionKind.SWA)
    pages = sum(len(q) // cfg.page_size + 1 for q in seqs)
    room = int(1.5 * pages * (bf + bs)) + (64 << 20)
    budgets = Budgets(room, room, room, l1_swa_full_ratio=1.0, l2_swa_full_ratio=1.0)
    result = {"contexts": [len(q) for q in seqs], "turns": len(turns)}
    for setup in (Setup("checkpointed", l2=True, l3=True), Setup("SWA-unaware", l2=True, l3=True, swa_unaware=True)):
        srv, root = start_server(room, 0)
        got = {}
        try:
            simulate(
                turns,
                cfg,
                setup,
                budgets,
                1,
                sched,
                cost,
                timing,
                srv.address,
                0.05,
                seed,
                inspect=lambda pool: got.update(_tier_holdings(pool[0], seqs, cfg)),
            )
        finally:
            stop_server(srv, root)
        result[setup.name] = got
    return result
