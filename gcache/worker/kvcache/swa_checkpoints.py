"""The checkpoint policy of the worker's cache: which of a request's SWA pages it keeps.

A request keeps SWA KV only for its window and for the window tails of its checkpoints
(CheckpointRule, gcache/serving/checkpoints.py: its end and resend point, its branch point off
the tree, every C pages); everything else goes back to the SWA pool as soon as it leaves the
window. So each tier holds a prefix's SWA cost O(W) per checkpoint. With swa_keep_spare (the
first-reuse fix) the pages no checkpoint needs wait instead, as spare pages, until the pool
needs them (trim under evict()).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gcache.serving.checkpoints import CheckpointRule
from gcache.serving.swa_window import tail_start_page

if TYPE_CHECKING:  # the engine room sits above this one: for annotations only
    from gcache.worker.engine.request import Request
    from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV
    from gcache.worker.kvcache.tiered_config import TieredCacheConfig


class SWACheckpoints:
    def __init__(self, kv: DualKVCache, config: TieredCacheConfig) -> None:
        self.kv, self.ps, self.window = kv, kv.page_size, kv.window
        self.rule = CheckpointRule(self.ps, config.swa_checkpoint_pages)
        self.ends = config.swa_checkpoint_ends  # off only in the regression test of failure mode 4
        self.keep_spare = config.swa_keep_spare

    def keep(self, req: Request, page: int, npages: int, end_is_checkpoint: bool = True) -> bool:
        """Whether page's SWA KV is kept: it lies in the window tail of a checkpoint up to
        npages: the end (a request or turn end; a re-lock point mid-decode is not one), the
        branch point off the tree, every C pages."""
        ends: list[int] = []
        if self.ends:
            ends.append(req.branch_page)
            if end_is_checkpoint:
                ends += self.end_points(req)
        return self.rule.in_a_tail(page, npages, self.window, ends)

    def end_points(self, req: Request) -> tuple[int, int]:
        """The resume points of req's end (CheckpointRule.end_points: its whole pages, and the
        page a resend of the same tokens resumes at); callers pass npages == its whole pages."""
        return self.rule.end_points(req.num_computed)

    def end_tail_start(self, req: Request) -> int:
        """The first page the window tails of req's end points need."""
        return tail_start_page(min(self.end_points(req)), self.ps, self.window)

    def written_swa(self, req: Request, npages: int, end_is_checkpoint: bool) -> list[int | None]:
        """req's SWA page ids of its first npages that go down to L2/L3 (checkpoint tails
        only; None elsewhere), so lower tiers hold O(W) SWA per checkpoint."""
        swa = req.held_kv.swa_pages
        return [
            swa[i] if swa[i] is not None and self.keep(req, i, npages, end_is_checkpoint) else None
            for i in range(npages)
        ]

    def spare(self, req: Request, npages: int) -> list[int]:
        """Pages of req it owns with live SWA outside the window and every checkpoint tail:
        spare for the tree (kept, evicted first)."""
        kv = req.held_kv
        if not self.keep_spare:
            return []
        end = tail_start_page(npages, self.ps, self.window)
        return [i for i in range(kv.owned_from, end) if kv.swa_pages[i] is not None and not self.keep(req, i, npages)]

    def trim_swa(self, req: Request, pressure: bool = False) -> int:
        """Free req's own SWA pages out of its window (one page of margin, so the end tail
        of its whole pages stays) and, unless under pressure, outside its checkpoint tails.
        With swa_keep_spare the latter wait until evict() needs them (first-reuse fix)."""
        if not pressure and self.keep_spare:
            return 0
        return self.trim(req, pressure)

    def trim(self, req: Request, pressure: bool, limit: int | None = None) -> int:
        """limit: free at most that many, oldest first (the pages nearest the request's end are
        the likeliest divergence points of a later request: keep them longest)."""
        kv, n = req.held_kv, req.num_computed
        idx = kv.swa_out_of_window(n - self.ps)
        if not pressure:
            npages = n // self.ps
            idx = [i for i in idx if not self.keep(req, i, npages)]
        return self._free_swa(kv, idx if limit is None else idx[:limit])

    def trim_to_checkpoints(self, req: Request, npages: int) -> None:
        """At the end (without swa_keep_spare): free req's own SWA pages no checkpoint needs."""
        kv = req.held_kv
        idx = [
            i
            for i in range(kv.owned_from, min(npages, kv.num_pages))
            if kv.swa_pages[i] is not None and not self.keep(req, i, npages)
        ]
        self._free_swa(kv, idx)

    def _free_swa(self, kv: RequestKV, idx: list[int]) -> int:
        self.kv.swa.free([kv.swa_pages[i] for i in idx])
        for i in idx:
            kv.swa_pages[i] = None
        return len(idx)
