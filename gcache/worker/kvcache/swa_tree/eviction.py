"""Two-phase eviction of the SWA radix tree: SWAEviction, an object the tree holds, over the
tree as a small Protocol (EvictionHost: the tree's state plus two hooks).

Phase 1, full deficit: remove the least-recent unlocked leaves (their full and SWA pages
go back to the pools); a parent left as a leaf that no longer ends window-safe is cut back
to its last window-safe page, or removed, and so on up.

Phase 2, SWA deficit: free SWA pages in four tiers, least-recent nodes first in each:
  spare. pages no checkpoint needs (insert(spare=...)): they would have been freed already
     if nothing had been worth keeping them for (the first-reuse fix);
  0. pages in no window-safe node end's tail (they only serve matches ending mid-node);
  1. tails of ends that are single-child internal nodes (an earlier turn a later one extends);
  2. tails of leaves and branch points, the ends live requests match. Breaking a leaf's
     tail removes the leaf (its full KV is useless without a window); breaking a branch
     point tombstones it (its children keep their own windows).
So the window-safe tails of live branches go last.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from gcache.worker.integrity import require
from gcache.worker.kvcache.swa_tree.node import TreeNode, TreeState


class EvictionHost(TreeState, Protocol):
    """What eviction needs of the tree it serves beyond its state (SWARadixTree)."""

    def last_safe_offset(self, node: TreeNode, swa: list[int | None]) -> int: ...
    def evicting(self, keys: list[str], full_ids: list[int | None], swa_ids: list[int | None]) -> None: ...


class SWAEviction:
    """The tree's eviction, held by the tree (SWARadixTree.eviction): it frees pages of the
    tree it serves and keeps that tree's invariants ('every leaf ends window-safe')."""

    def __init__(self, tree: EvictionHost) -> None:
        self.tree = tree

    def evict(self, full_pages_needed: int, swa_pages_needed: int) -> tuple[int, int]:
        """Free at least the given numbers of pages where unlocked ones allow; returns
        (full, swa) pages actually freed to the pools."""
        for name, v in (("full_pages_needed", full_pages_needed), ("swa_pages_needed", swa_pages_needed)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"evict: {name} must be a non-negative int, got {v!r}")
        freed = [0, 0]
        if full_pages_needed:
            self._evict_leaves(full_pages_needed, freed, protect=frozenset(), by_nodes=False)
        if freed[1] < swa_pages_needed:
            self._evict_swa(swa_pages_needed, freed)
        return freed[0], freed[1]

    # ---- phase 1 -----------------------------------------------------------------------
    def _evict_leaves(self, needed: int, freed: list, protect, by_nodes: bool) -> None:
        """Remove least-recent unlocked leaves until `needed` full pages (or nodes) are gone.
        One pass suffices: a parent sits after its children in the LRU order, so a parent
        that becomes a leaf is still ahead of the cursor."""
        nodes_before = self.tree.num_nodes
        for node in list(self.tree.full_lru):
            done = (nodes_before - self.tree.num_nodes) if by_nodes else freed[0]
            if done >= needed:
                return
            if node.removed or node.children or node.full_lock or node in protect:
                continue
            parent = node.parent
            self._remove_leaf(node, freed)
            if parent not in protect:
                self.settle(parent, freed)

    def evict_nodes(self, count: int, protect) -> None:
        self._evict_leaves(count, [0, 0], protect, by_nodes=True)

    # ---- phase 2 -----------------------------------------------------------------------
    def _evict_swa(self, needed: int, freed: list) -> None:
        """Tier by tier, least-recent nodes first; protection is computed per node when it
        is visited, so a call that finds enough old tier-0 pages stays cheap."""
        guard = len(self.tree.spare_owner) + 1  # every round frees or drops what it takes
        while self.tree.spare_owner and freed[1] < needed and guard > 0:
            guard -= 1
            take = dict(itertools.islice(self.tree.spare_owner.items(), needed - freed[1]))  # oldest first
            by_node: dict = {}
            for page, node in take.items():
                by_node.setdefault(node, set()).add(page)
            for node, pages in by_node.items():
                if not node.removed:
                    self._drop_swa(node, [j for j, sp in enumerate(node.swa) if sp in pages], freed)
            for page in take:  # anything not freed above is no longer spare-held: forget it
                self.tree.spare_owner.pop(page, None)
        for tier in (0, 1, 2):
            for node in list(self.tree.swa_lru):
                if freed[1] >= needed:
                    return
                if node.removed or not node.live_swa:
                    continue
                suf1, suf2, own = self._node_protection(node)
                if tier == 0:
                    hi = len(node.keys) - suf1
                    if node.live_swa == sum(s is not None for s in node.swa[hi:]):
                        continue  # every live page is protected
                    js = [j for j in range(hi) if node.swa[j] is not None and not node.swa_locks[j]]
                    self._drop_swa(node, js[: needed - freed[1]], freed)
                elif own == tier and not node.children:
                    if not node.full_lock:  # a leaf's window is its only use: drop it whole
                        parent = node.parent
                        self._remove_leaf(node, freed)
                        self.settle(parent, freed)
                elif own == tier:
                    hi = len(node.keys) - (suf2 if tier == 1 else 0)
                    js = [j for j in range(hi) if node.swa[j] is not None and not node.swa_locks[j]]
                    self._drop_swa(node, js, freed)

    def _node_protection(self, node):
        """(suffix of node's pages in the tail of a window-safe node end of tier >= 1,
        suffix in the tail of a tier-2 end, tier of node's own end or None). Ends that can
        reach into node: its own, and descendants ending less than a window below it."""
        size = len(node.keys)
        end = node.start + size
        suf = [0, 0, 0]
        own = self._end_tier(node, size, end)
        if own:
            suf[own] = min(size, self.tree.tail(end))
        stack = list(node.children.values())
        while stack:
            d = stack.pop()
            dsize = len(d.keys)
            dend = d.start + dsize
            reach = end - (dend - self.tree.tail(dend))  # pages of node inside d's window tail
            if reach > 0:
                tier = self._end_tier(d, dsize, dend)
                if tier and suf[tier] < reach:
                    suf[tier] = min(size, reach)
            if dend < end + self.tree.tail_max:
                stack.extend(d.children.values())
        return max(suf[1], suf[2]), suf[2], own

    def _end_tier(self, node, size: int, end: int):
        """1 for a window-safe end with one child (an earlier turn a later one extends),
        2 for a window-safe leaf or branch point, None if the end is not window-safe."""
        need = self.tree.tail(end)
        if node.swa[-1] is None or self.tree.live_run_at(node, size, need) < need:
            return None
        return 1 if len(node.children) == 1 else 2

    # ---- page and node removal -----------------------------------------------------------
    def _drop_swa(self, node, js: list, freed: list) -> None:
        """Tombstone pages js of node, then restore 'every leaf ends window-safe'."""
        if not js:
            return
        pages = []
        for j in js:
            require(node.swa[j] is not None and not node.swa_locks[j], "tombstoning a dead or locked SWA page")
            pages.append(node.swa[j])
        self.tree.evicting([node.keys[j] for j in js], [None] * len(js), pages)
        for j in js:
            node.swa[j] = None
        self.tree.swa_pool.free(pages)
        self.tree.swa_owned.difference_update(pages)
        for p in pages:
            self.tree.spare_owner.pop(p, None)
        node.live_swa -= len(pages)
        freed[1] += len(pages)
        if not node.live_swa:
            del self.tree.swa_lru[node]
        if not node.children:
            self.settle(node, freed)
        else:
            self._settle_below(node, freed)

    def _settle_below(self, node, freed: list) -> None:
        """Leaves close enough below node to have their window tail in it may have lost
        their window: settle them (a node's children are visited before they can be removed)."""
        limit = node.end + self.tree.tail_max
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            if n.removed or n.start >= limit:
                continue
            if n.children:
                stack.extend(n.children.values())
            else:
                self.settle(n, freed)

    def _remove_leaf(self, node, freed: list) -> None:
        require(
            node is not self.tree.root and not node.children and not node.full_lock,
            "removing the root, an inner node or a locked leaf",
        )
        self._free_pages(node, 0, freed)
        del node.parent.children[node.keys[0]]
        del self.tree.full_lru[node]
        self.tree.swa_lru.pop(node, None)
        node.removed = True
        self.tree.num_nodes -= 1

    def _free_pages(self, node, k: int, freed: list) -> None:
        """Free node's pages from index k on (both pools) and cut them off."""
        full = node.full[k:]
        if full:
            self.tree.evicting(node.keys[k:], full, node.swa[k:])
        swa = [s for s in node.swa[k:] if s is not None]
        self.tree.full_pool.free(full)
        self.tree.swa_pool.free(swa)
        self.tree.full_owned.difference_update(full)
        self.tree.swa_owned.difference_update(swa)
        for p in swa:
            self.tree.spare_owner.pop(p, None)
        freed[0] += len(full)
        freed[1] += len(swa)
        node.live_swa -= len(swa)
        if k:
            for lst in (node.keys, node.full, node.swa, node.swa_locks):
                del lst[k:]
            if not node.live_swa:
                self.tree.swa_lru.pop(node, None)

    def settle(self, node, freed: list) -> None:
        """Restore 'every leaf ends window-safe' from node upward: cut an unlocked leaf back
        to its last window-safe page, or remove it and look at its parent."""
        while node is not self.tree.root and not node.removed and not node.children and not node.full_lock:
            keep = self.tree.last_safe_offset(node, node.swa)
            if keep == len(node):
                return
            if keep:
                self._free_pages(node, keep, freed)
                return
            parent = node.parent
            self._remove_leaf(node, freed)
            node = parent
