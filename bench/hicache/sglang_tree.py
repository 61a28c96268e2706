"""An SGLang-SWARadixCache-style L1 tree: the second baseline of bench/hicache/hierarchy.py.

SGLang's SWARadixCache (python/sglang/srt/mem_cache/swa_radix_cache.py,
_match_prefix_helper) walks the tree node by node, counting the tokens matched since the
last SWA tombstone, and only accepts a match END AT A NODE BOUNDARY (a fully matched node,
or the point where the input leaves a node, which it splits there) whose last W tokens
hold no tombstone. It cannot end a match part-way along a node, so a tombstone inside
the window of a branch's end makes the branch unmatchable beyond the last window-safe
node boundary above it, even where live SWA KV exists at an earlier page of that node.

This subclass keeps everything of the real SWARadixTree (pages, locks, the two-phase
eviction, which is smarter than SGLang's, so the baseline is if anything favoured) and
changes only that rule: match candidates are node boundaries and the stop point, each
accepted only if its window tail is tombstone-free. Tombstones are per page here (SGLang's
are per node, from splitting at the evicted length), so "no tombstone in the window" is
exactly SGLang's "tokens since the last tombstone >= W" at those candidates.

bench/hicache/hierarchy.py installs it with BenchHiCache(tree_cls=SGLangSWATree), which replaces
engine.cache.tree before the engine sees any request.
"""
from __future__ import annotations

import numpy as np

from gcache.worker.kvcache.swa_radix_tree import SWARadixTree
from gcache.worker.kvcache.swa_tree_node import MatchResult
from gcache.serving.swa_window import tail_start_page


class SGLangSWATree(SWARadixTree):
    def match(self, tokens, max_len: int | None = None, keys: list | None = None) -> MatchResult:
        keys = self._page_keys(tokens, aligned=False, keys=keys)
        if max_len is None:
            max_len = max(0, len(tokens) - 1)
        if not isinstance(max_len, (int, np.integer)) or max_len < 0:
            raise ValueError(f"max_len must be a non-negative int, got {max_len!r}")
        limit = min(len(keys), int(max_len) // self.page_size)
        node, i, run = self.root, 0, 0
        best_i, best_node, best_off = 0, self.root, 0
        bound_i, bound_node = 0, self.root  # best match on an existing node boundary
        while i < limit:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck, cs, j = child.keys, child.swa, 0
            while j < len(ck) and i < limit and ck[j] == keys[i]:
                run = run + 1 if cs[j] is not None else 0
                i, j = i + 1, j + 1
            if run >= self._tail(i):  # the only candidate inside this node: where we left it
                best_i, best_node, best_off = i, child, j
                if j == len(ck):
                    bound_i, bound_node = i, child
            if j < len(ck):
                break
            node = child
        handle = best_node
        if best_node is not self.root and best_off < len(best_node):
            if self.num_nodes < self.nodes_max:
                handle = self._split(best_node, best_off)  # SGLang splits at the stop point too
            else:
                best_i, handle = bound_i, bound_node
        full, swa = self._path_pages(handle)
        assert len(full) == best_i
        swa[: tail_start_page(best_i, self.page_size, self.window)] = []
        swa[:0] = [None] * (best_i - len(swa))
        self._touch(handle)
        return MatchResult(best_i * self.page_size, tuple(full), tuple(swa), handle, i * self.page_size)
