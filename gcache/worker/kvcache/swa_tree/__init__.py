"""The L1 index: the SWA-aware radix tree over the device pools (tree: SWARadixTree), its nodes
and match result (node), its two-phase eviction, an object the tree holds (eviction:
SWAEviction), and its invariants recomputed from scratch (check)."""
