"""TieredPrefixCache: the prefix cache across tiers, L1 (device pools + SWA radix tree), L2
(host pool), L3 (GCache). It coordinates the tiers; which SWA pages a request keeps is the
checkpoint policy's (swa_checkpoints.py), the counters are CacheStats' (cache_stats.py).

How a prefix moves (see cache_manager.py for the contract the engine relies on):
  * match: the L1 tree gives the longest window-safe prefix P1 on the device; L2 extends it
    page by page through the page-hash chain (a dict lookup per page) up to its last
    window-safe point; pages an L3 prefetch brought in are in L2 by then.
  * load: the L2 part is copied into fresh device pages, full KV for every page and SWA
    KV for the window tail only (never SWA for the whole prefix), layer by layer. When the
    device pools cannot hold it all, the load is cut to the last window-safe point that
    fits (failure mode 2: never all-or-nothing).
  * write: pages entering the L1 tree go to L2 and L3 per the write policy; L1 eviction
    demotes pages under write_back.
  * SWA checkpoints in every tier (SWACheckpoints): a request keeps SWA KV only for its window
    and for the window tails of its checkpoints (its end, its branch point off the tree, every
    C pages); everything else goes back to the SWA pool as soon as it leaves the window.
    So each tier holds a prefix's SWA cost O(W) per checkpoint, and a prefix is loadable
    from a tier up to its last checkpoint whose full pages are all there.
  * spare SWA in L1 (swa_keep_spare, the first-reuse fix): the SWA pages a request would
    free that way are kept instead while the pool has room, and handed to the tree as
    spare pages (evicted before anything else). So B = S + q2 after A = S + q1 hits S on
    an idle worker; when the pool needs pages, evict() frees running requests' such pages
    first, then the tree's spare ones, and only then what it freed before the fix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, cast

from gcache.common.attention import AttentionKind
from gcache.serving.checkpoints import CheckpointRule
from gcache.serving.swa_window import last_safe_end, tail_start_page
from gcache.serving.tiers import Tier
from gcache.worker.integrity import require
from gcache.worker.kvcache.cache_manager import CacheManager, MatchResult, NoLoads
from gcache.worker.kvcache.cache_stats import CacheStats
from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV
from gcache.worker.kvcache.policies import prefetch_rule, write_rule
from gcache.worker.kvcache.swa_checkpoints import SWACheckpoints
from gcache.worker.kvcache.swa_tree.tree import SWARadixTree
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.kvcache.tiers.host_cache import HostCache, HostPage, stored_prefix
from gcache.worker.kvcache.tiers.host_pool import HostKVPool
from gcache.worker.kvcache.tiers.l3_store import L3Config, L3Store
from gcache.worker.kvcache.tiers.layer_load import LoadBatch, PageLoad
from gcache.worker.kvcache.tiers.mtp_tails import MTPTails

if TYPE_CHECKING:  # the engine room sits above this one: for annotations only
    from gcache.worker.engine.request import Request


class TieredPrefixCache(CacheManager):
    def __init__(
        self, kv: DualKVCache, config: TieredCacheConfig | None = None, nodes_max: int = 1_000_000, l3_client=None
    ) -> None:
        config = config if config is not None else TieredCacheConfig()
        self.kv, self.config = kv, config
        self.write_rule, self.prefetch_rule = write_rule(config), prefetch_rule(config)
        self.ps, self.window = kv.page_size, kv.window
        self.swa_checkpoints = SWACheckpoints(kv, config)  # which SWA pages a request keeps
        self.checkpoint_rule: CheckpointRule = self.swa_checkpoints.rule
        self.tree = SWARadixTree(self.ps, self.window, kv.full, kv.swa, nodes_max=nodes_max)
        self.host: HostCache | None = None
        self.l3: L3Store | None = None
        if config.l2_bytes:
            pool = HostKVPool.from_budget(kv.config, config.l2_bytes, config.l2_swa_full_ratio, kv.xp)
            self.host = HostCache(pool, protect_prefix=config.l3_protect_prefix)
            if config.l3_url:
                l3c = L3Config(
                    url=config.l3_url,
                    model=config.model_name,
                    timeout_s=config.l3_timeout_s,
                    write_queue_max=config.l3_write_queue_max,
                    protect_prefix=config.l3_protect_prefix,
                )
                self.l3 = L3Store(l3c, self.host, self.window, self.ps, client=l3_client)
            if self.write_rule.writes_at_evict:
                self.tree.on_evict = self._demote
        # the `mtp` pool: MTP tails of checkpoints, down the same tiers (mtp_tails.py)
        l2_tails = config.mtp_tail_bytes if self.host is not None else 0
        self.mtp = MTPTails(config.mtp_tail_bytes, l2_tails, self.l3) if config.mtp_tail_bytes else None
        if self.mtp is not None:
            self.tree.observers.append(self.mtp)
        self._running: dict[int, Request] = {}  # rid -> request holding pages (for evict's trim)
        self._loads: list[PageLoad] = []
        self._hits: OrderedDict[str, int] = OrderedDict()  # write_through_selective
        self.cache_stats = CacheStats()

    # ---- lookups ---------------------------------------------------------------------------
    def _limit_pages(self, req) -> int:
        return (req.num_tokens - 1) // self.ps  # always leave a token to compute

    def _host_end(self, keys: list[str], start: int) -> int:
        """Last window-safe end (pages) reachable from `start` through L2."""
        if self.host is None:
            return start
        n, swa = self.host.run(keys, start)
        return last_safe_end(start, n, lambda i: swa[i - start], self.ps, self.window)

    def match(self, req) -> MatchResult:
        all_keys = req.page_keys()
        keys = all_keys[: self._limit_pages(req)]
        m = self.tree.match(req.tokens(), keys=all_keys)
        p1 = m.prefix_len // self.ps
        end = self._host_end(keys, p1)
        return MatchResult(
            l1_len=m.prefix_len,
            l2_len=end * self.ps,
            l3_len=end * self.ps,
            device_pages=m.full_pages,
            host_keys=tuple(keys[p1:end]),
            node=m.node,
            present_len=m.present_len,
        )

    def prefix_swa_pages(self, req) -> list:
        own, tree = req.kv.swa_pages, self.tree.path_swa_pages(req.lock_node)
        return [p if p is not None or i >= len(tree) else tree[i] for i, p in enumerate(own)]

    def estimate_uncached(self, req) -> int:
        return req.num_tokens - self.match(req).total

    def ready(self, req) -> bool:
        pf = req.prefetch
        if pf is None or pf.done.is_set():
            return True
        return self.prefetch_rule.ready(pf.started_s)

    def poll(self, waiting) -> None:
        """Start L3 prefetches for waiting requests not yet looked up (bounded per step)."""
        if self.l3 is None or not self.l3.available():
            return
        started = 0
        for r in waiting:
            if started >= self.config.prefetches_per_step:
                return
            if r.prefetch is not None or r.prefetch_tried:
                continue
            r.prefetch_tried = True
            limit = self._limit_pages(r)
            start = self.match(r).total // self.ps
            if start < limit:
                r.prefetch = self.l3.submit_prefetch(r.page_keys()[:limit], start)
                started += 1

    # ---- load --------------------------------------------------------------------------------
    def prepare_load(self, req) -> MatchResult:
        ps, W = self.ps, self.window
        all_keys = req.page_keys()
        keys = all_keys[: self._limit_pages(req)]
        m = self.tree.match(req.tokens(), keys=all_keys)
        self.tree.lock(m.node)
        req.lock_node = m.node
        self._running[req.rid] = req
        req.branch_page = m.present_len // ps
        p1 = m.prefix_len // ps
        first = tail_start_page(p1, ps, W)  # borrow SWA only for the locked window tail
        swa = [p if i >= first else None for i, p in enumerate(m.swa_pages)]
        req.kv = RequestKV.from_prefix(ps, W, m.prefix_len, m.full_pages, swa)
        if p1 and self.host is not None and self.write_rule.writes_at_insert:
            # req resumes here: a checkpoint now (it may have been spare SWA in L1 only), so its
            # window tail goes down like any checkpoint's (a no-op when L2 has it)
            idx = self.write_rule.at_insert(range(first, p1), keys, self._hits)
            self._write_pages(keys[:p1], idx, m.full_pages, swa, chain=keys[:p1])
        self._count_hits(keys[:p1], m.full_pages, swa)
        end, l3_keys = p1, ()
        if self.host is not None:
            end = self._load_from_host(req, keys, p1)
            fetched = req.prefetch.fetched if req.prefetch is not None else set()
            l3_keys = tuple(k for k in keys[p1:end] if k in fetched)
            self.host.touch_chain(keys[:end])
        if req.prefetch is not None:
            if self.l3 is None:  # cannot happen: a prefetch came from it
                raise RuntimeError("invariant broken: a prefetch came from it")
            self.l3.release(req.prefetch, cancelled=not req.prefetch.done.is_set())
            req.prefetch = None
        l3 = len(l3_keys) * ps
        by_tier = {Tier.L1: m.prefix_len, Tier.L2: (end - p1) * ps - l3, Tier.L3: l3}
        return MatchResult(
            l1_len=m.prefix_len,
            l2_len=end * ps,
            l3_len=end * ps,
            device_pages=m.full_pages,
            host_keys=tuple(keys[p1:end]),
            l3_keys=l3_keys,
            node=m.node,
            present_len=m.present_len,
            by_tier=by_tier,
        )

    def _load_from_host(self, req, keys: list[str], p1: int) -> int:
        """Queue the copy of L2 pages [p1, E) into new device pages; returns E (p1 if none).
        Pins first, so what is measured is what gets copied."""
        host, kvc, ps, W = self.host, self.kv, self.ps, self.window
        if host is None:  # cannot happen: called with an L2 only
            raise RuntimeError("invariant broken: called with an L2 only")
        n, _ = host.run(keys, p1)
        if not n:
            return p1
        pinned = host.pin(keys[p1 : p1 + n])
        k = 0  # a prefetch thread may have evicted a page between run and pin: stop there
        while k < len(pinned) and pinned[k] == keys[p1 + k]:
            k += 1
        host.unpin(pinned[k:])
        pinned = pinned[:k]
        n, swa = host.run(keys[: p1 + k], p1)  # pinned: stable from here on
        want = last_safe_end(p1, n, lambda i: swa[i - p1], ps, W) - p1
        if want <= 0:
            host.unpin(pinned)
            return p1
        short = want + 1 - kvc.full.num_free  # + 1: room for the token left to compute
        if short > 0:
            self.evict(short, 0)
        fit = min(want, kvc.full.num_free - 1)
        if fit < want and not self.config.chunk_loads:
            fit = 0  # all-or-nothing (only the regression test of failure mode 2 does this)
        end = last_safe_end(p1, max(0, fit), lambda i: swa[i - p1], ps, W)
        if end - p1 < want:
            self.cache_stats.add("loads_cut_to_fit")
        tail_lo = max(p1, tail_start_page(end, ps, W))
        if end > p1 and kvc.swa.num_free < end - tail_lo:
            self.evict(0, end - tail_lo - kvc.swa.num_free)
        full_dev = kvc.full.alloc(end - p1) if end > p1 else None
        swa_dev = kvc.swa.alloc(end - tail_lo) if full_dev is not None else None
        if swa_dev is None:
            if full_dev is not None:
                kvc.full.free(full_dev)
            host.unpin(pinned)
            return p1
        if full_dev is None:  # cannot happen: swa_dev is only allocated after it
            raise RuntimeError("invariant broken: swa_dev is only allocated after it")
        entries = cast("list[HostPage]", [host.get(k) for k in keys[p1:end]])  # pinned: all there
        kv = req.kv
        kv.full_pages += full_dev
        kv.swa_pages += [None] * (tail_lo - p1) + swa_dev
        kv.num_tokens = end * ps
        host.unpin(pinned[end - p1 :])
        self._loads.append(
            PageLoad(
                req,
                (full_dev, [e.full for e in entries]),
                (swa_dev, cast("list[int]", [e.swa for e in entries[tail_lo - p1 :]])),  # last_safe_end: live
                pinned[: end - p1],
            )
        )
        return end

    def start_loads(self):
        if not self._loads:
            return NoLoads()
        if self.host is None:  # cannot happen: loads come from L2
            raise RuntimeError("invariant broken: loads come from L2")
        batch = LoadBatch(
            self.kv, self.host, self._loads, self.config.layerwise_load, self.config.load_throttle_bytes_per_s
        )
        self._loads = []
        self.cache_stats.add("l2_load_pages", sum(len(ld.full[0]) for ld in batch.loads))
        self.cache_stats.add("l2_load_bytes", batch.bytes)
        batch.on_finish = self._load_finished
        return batch.start()

    def _load_finished(self, batch: LoadBatch) -> None:
        self.cache_stats.add("l2_load_seconds", batch.copy_s)
        self.cache_stats.add("l2_load_wait_seconds", batch.wait_s)

    # ---- write -------------------------------------------------------------------------------
    def prepare_write(self, req, final: bool) -> None:
        ps, kv = self.ps, req.kv
        npages = req.num_computed // ps
        if final and not self.config.swa_keep_spare:
            self.swa_checkpoints.trim_to_checkpoints(req, npages)
        first = tail_start_page(npages, ps, self.window)
        if npages <= kv.owned_from:
            return  # nothing new
        if not final and any(p is None for p in kv.swa_pages[first:npages]):
            return  # its window tail was dropped under pressure: not matchable, cannot relock
        keys = req.page_keys(npages)
        tokens = req.tokens(npages * ps)
        if self.host is not None and self.write_rule.writes_at_insert:
            # Both ends of a turn are checkpoints: the prompt's (a resend or a new continuation
            # of the same prompt resumes there) and the answer's (the next turn resumes there).
            self._write_through(req, keys, npages, end_is_checkpoint=final or len(req.output) <= 1)
        self.tree.insert(
            tokens,
            kv.full_pages[:npages],
            kv.swa_pages[:npages],
            keys=keys,
            spare=self.swa_checkpoints.spare(req, npages),
        )
        if final:
            kv.owned_from = npages  # the tree owns them now
            return
        m = self.tree.match(tokens, max_len=len(tokens), keys=keys)
        require(m.prefix_len == npages * ps, f"inserted {npages * ps} tokens, matched {m.prefix_len}")
        self.tree.lock(m.node)
        self.tree.unlock(req.lock_node)
        req.lock_node = m.node
        kv.full_pages[:npages] = list(m.full_pages)
        kv.swa_pages[:npages] = [p if i >= first else None for i, p in enumerate(m.swa_pages)]
        kv.owned_from = npages

    def _write_through(self, req, keys: list[str], npages: int, end_is_checkpoint: bool) -> None:
        """The request's new pages (and the window tail of its end, which it may hold
        borrowed) to L2/L3, before insert (the tree may free duplicate pages). SWA goes
        down only for checkpoint tails, so lower tiers hold O(W) SWA per checkpoint."""
        kv = req.kv
        lo = kv.owned_from
        if end_is_checkpoint:
            lo = min(lo, self.swa_checkpoints.end_tail_start(req))
        idx = self.write_rule.at_insert(range(lo, npages), keys, self._hits)
        swa = self.swa_checkpoints.written_swa(req, npages, end_is_checkpoint)
        self._write_pages(keys, idx, kv.full_pages, swa, chain=keys)

    def _count_hits(self, keys: list[str], full_pages, swa_pages) -> None:
        """write_through_selective: pages matched in L1 count a hit; at the threshold they
        are written to L2/L3 (from the device pages the tree holds)."""
        if self.host is None or not self.write_rule.counts_hits:
            return
        crossing = []
        for i, k in enumerate(keys):
            c = self._hits.pop(k, 0) + 1
            self._hits[k] = c
            if c == self.config.write_threshold:
                crossing.append(i)
        while len(self._hits) > self.config.hit_counts_max:
            self._hits.popitem(last=False)
        self._write_pages(keys, crossing, full_pages, swa_pages, chain=keys)

    def _demote(self, keys: list[str], full_ids: list, swa_ids: list) -> None:
        """write_back: the tree is about to free these device pages; keep them in L2."""
        self._write_pages(keys, range(len(keys)), full_ids, swa_ids, chain=keys)

    def _write_pages(self, keys, idx, full_ids, swa_ids, chain: list[str]) -> None:
        """Device pages -> L2 for pages idx (full where given and absent in L2, SWA where
        live and absent), then queue every page of `chain` that L2 has and L3 lacks."""
        host = self.host
        if host is None:  # cannot happen: called with an L2 only
            raise RuntimeError("invariant broken: called with an L2 only")
        pool = host.pool
        new_full: list[int] = []
        new_swa: list[int] = []
        for i in idx:
            e = host.get(keys[i])
            if e is None and full_ids[i] is not None:
                new_full.append(i)
            if swa_ids[i] is not None and (e is None or e.swa is None):
                new_swa.append(i)
        picked = {AttentionKind.FULL: new_full, AttentionKind.SWA: new_swa}
        slots: dict[AttentionKind, list[int]] = {}
        for kind in (AttentionKind.FULL, AttentionKind.SWA):
            got = host.reserve(kind, len(picked[kind])) if picked[kind] else []
            if got is None:  # L2 full of pinned pages: this write is dropped
                self.cache_stats.add("l2_write_dropped", len(picked[kind]))
                picked[kind], got = [], []
            slots[kind] = got
        new_full, new_swa = picked[AttentionKind.FULL], picked[AttentionKind.SWA]
        pool.store_from_device(self.kv, AttentionKind.FULL, [full_ids[i] for i in new_full], slots[AttentionKind.FULL])
        pool.store_from_device(self.kv, AttentionKind.SWA, [swa_ids[i] for i in new_swa], slots[AttentionKind.SWA])
        full_of = dict(zip(new_full, slots[AttentionKind.FULL]))
        swa_of = dict(zip(new_swa, slots[AttentionKind.SWA]))
        for i in sorted(set(new_full) | set(new_swa)):
            host.publish(keys[i], full_of.get(i), swa_of.get(i), origin=Tier.L1)
        self.cache_stats.add("l2_write_pages", len(new_full))
        self.cache_stats.add(
            "l2_write_bytes",
            len(new_full) * pool.page_bytes[AttentionKind.FULL] + len(new_swa) * pool.page_bytes[AttentionKind.SWA],
        )
        if self.l3 is not None and (new_full or new_swa):
            self._write_l3(chain)

    def _write_l3(self, chain: list[str]) -> None:
        if self.l3 is None or self.host is None:  # cannot happen: called with an L3 only
            raise RuntimeError("invariant broken: called with an L3 only")
        if not self.l3.available():
            self.cache_stats.add("l3_writes_skipped_down")
            return
        pages = self.host.claim_for_l3(chain)
        if pages and not self.l3.submit_write(pages, chain):
            self.host.finish_l3([h for h, _, _ in pages], False)

    # ---- SWA checkpoints (swa_checkpoints.py) ---------------------------------------------
    def trim_swa(self, req, pressure: bool = False) -> int:
        return self.swa_checkpoints.trim_swa(req, pressure)

    # ---- locks, release, eviction ----------------------------------------------------------
    def lock(self, node) -> None:
        self.tree.lock(node)

    def unlock(self, node) -> None:
        self.tree.unlock(node)

    def release(self, req) -> None:
        mine = [ld for ld in self._loads if ld.req is req]
        if mine:  # admitted and dropped in the same step: its copies never start
            self._loads = [ld for ld in self._loads if ld.req is not req]
            if self.host is None:  # cannot happen: loads come from L2
                raise RuntimeError("invariant broken: loads come from L2")
            for ld in mine:
                self.host.unpin(ld.pinned)
        req.kv.release(self.kv)
        self.tree.unlock(req.lock_node)
        self._running.pop(req.rid, None)
        req.kv, req.lock_node = None, None

    def drop_waiting(self, req) -> None:
        """A waiting request leaves (abort): its prefetch pins go."""
        if req.prefetch is not None:
            if self.l3 is None:  # cannot happen: a prefetch came from it
                raise RuntimeError("invariant broken: a prefetch came from it")
            self.l3.release(req.prefetch, cancelled=True)
            req.prefetch = None

    def evict(self, full_pages: int, swa_pages: int) -> tuple[int, int]:
        trimmed = 0
        if swa_pages and self.config.swa_keep_spare:  # first what trim_swa left for later
            for r in list(self._running.values()):
                if trimmed >= swa_pages:
                    break
                if r.kv is not None:
                    trimmed += self.swa_checkpoints.trim(r, pressure=False, limit=swa_pages - trimmed)
        f, s = self.tree.evict(full_pages, max(0, swa_pages - trimmed))
        return f, s + trimmed

    def cached_pages(self) -> tuple[int, int]:
        return self.tree.cached_pages()

    def checkpoints(self, tokens) -> list[int]:
        """Window-safe prefix points of `tokens` held on the device (for a router)."""
        return self.tree.checkpoints(tokens)

    # ---- integrity and stats -----------------------------------------------------------------
    def check_integrity(self, running, waiting=()) -> None:
        owned_full: list[int] = []
        owned_swa: list[int] = []
        for r in running:
            kv = r.kv
            owned_full += kv.full_pages[kv.owned_from :]
            owned_swa += [p for p in kv.swa_pages[kv.owned_from :] if p is not None]
        self.tree.check_integrity(owned_full, owned_swa)
        if self.mtp is not None:
            self.mtp.check_integrity()
        tree_full, tree_swa = self.tree.cached_pages()
        require(len(set(owned_full)) == len(owned_full), "a full page is owned by two requests")
        require(len(set(owned_swa)) == len(owned_swa), "an SWA page is owned by two requests")
        require(
            self.kv.full.num_used == tree_full + len(owned_full),
            f"full pages: {self.kv.full.num_used} used, tree {tree_full} + requests {len(owned_full)}",
        )
        require(
            self.kv.swa.num_used == tree_swa + len(owned_swa),
            f"swa pages: {self.kv.swa.num_used} used, tree {tree_swa} + requests {len(owned_swa)}",
        )
        if self.host is None:
            return
        self.host.check_integrity()
        if self.l3 is None or self.l3.idle():
            expected: dict[str, int] = {}
            holders = [ld.pinned for ld in self._loads]
            holders += [r.prefetch.pinned for r in waiting if r.prefetch is not None and r.prefetch.done.is_set()]
            for lst in holders:
                for k in lst:
                    expected[k] = expected.get(k, 0) + 1
            require(self.host.pins() == expected, "host pins disagree with the loads and prefetches that hold them")

    def stats(self) -> dict:
        return self.cache_stats.report(self.host, self.l3)

    # ---- the contract's accessors (cache_manager.py) ---------------------------------------
    def l1_tree(self) -> SWARadixTree:
        return self.tree

    def l2_cache(self) -> HostCache | None:
        return self.host

    def stored_in_l3(self, keys, swa_lo: int) -> tuple[int, bool]:
        return stored_prefix(self.host, keys, swa_lo) if self.host is not None else (0, False)

    def start(self) -> None:
        if self.l3 is not None:
            self.l3.probe()
            self.l3.watch()

    def l3_available(self) -> bool:
        return self.l3 is not None and self.l3.available()

    def l3_health(self) -> dict | None:
        return self.l3.health() if self.l3 is not None else None

    def l2_bytes(self) -> int:
        return self.host.pool.total_bytes() if self.host is not None else 0

    def key_model(self) -> str:
        return self.config.model_name

    def close(self) -> None:
        if self.l3 is not None:
            self.l3.close()
