"""An SGLang-SWARadixCache-style L1 tree: the second baseline of bench/hicache/hierarchy.py.

The real SWARadixTree (pages, locks, the two-phase eviction, which is smarter than SGLang's,
so the baseline is if anything favoured) with SGLang's match rule plugged in: a match ends
only at a node boundary whose window tail holds no SWA tombstone
(gcache.worker.kvcache.swa_tree.node.MatchEnds.NODE_BOUNDARY says exactly what that is).

bench/hicache/hierarchy.py installs it with BenchTieredCache(tree_cls=SGLangSWATree), which replaces
engine.cache.tree before the engine sees any request.
"""

from __future__ import annotations

from gcache.worker.kvcache.swa_tree.node import MatchEnds
from gcache.worker.kvcache.swa_tree.tree import SWARadixTree


class SGLangSWATree(SWARadixTree):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, match_ends=MatchEnds.NODE_BOUNDARY, **kwargs)
