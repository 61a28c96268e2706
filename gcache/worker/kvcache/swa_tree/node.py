"""Node and match result of the SWA-aware radix tree (see tree.py), and the tree's state as
eviction and the integrity check read it (TreeState)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from gcache.worker.kvcache.kv_pool import PagePool


class MatchEnds(Enum):
    """Where SWARadixTree.match may end a match; either way only at a window-safe point (the
    pages covering the W tokens before it hold live SWA KV).

    ANY_PAGE: at any page of the matched path (GCache's rule, the default), so a tombstone
    inside a branch's last W tokens only cuts the match back to the longest window-safe page
    before it.

    NODE_BOUNDARY: only at a node boundary, i.e. the end of a fully matched node or the point
    where the input leaves a node (split there), as SGLang's SWARadixCache does
    (python/sglang/srt/mem_cache/swa_radix_cache.py, _match_prefix_helper: tokens matched
    since the last SWA tombstone, checked per node). A tombstone inside the window of a
    branch's end then makes the branch unmatchable beyond the last window-safe node boundary
    above it, even where live SWA KV exists at an earlier page of that node. Tombstones are
    per page here (SGLang's are per node, from splitting at the evicted length), so "no
    tombstone in the window" at those candidates is exactly SGLang's "tokens since the last
    tombstone >= W". bench.hicache.sglang_tree uses it for the SGLang-style baseline.
    """

    ANY_PAGE = "any_page"
    NODE_BOUNDARY = "node_boundary"


class TreeNode:
    """An edge of one or more pages. Per page: its token key, a full-pool page id, an
    SWA-pool page id or None (an SWA tombstone: the full KV is cached, the SWA KV is not),
    and an SWA lock count. The full lock is per node: a full lock always covers a whole
    root..node path, so both halves of a split inherit it exactly."""

    __slots__ = ("parent", "children", "keys", "full", "swa", "swa_locks", "full_lock", "start", "live_swa", "removed")

    def __init__(
        self, parent: TreeNode | None, start: int, keys: list[str], full: list[int], swa: list[int | None]
    ) -> None:
        # None for the root only; every walk up stops at the root, so the type is the one the
        # nodes it is read on have
        self.parent: TreeNode = cast("TreeNode", parent)
        self.children: dict[str, TreeNode] = {}
        self.keys = keys
        self.full = full
        self.swa = swa
        self.swa_locks = [0] * len(keys)
        self.full_lock = 0
        self.start = start  # pages before this node on its path
        self.live_swa = sum(s is not None for s in swa)
        self.removed = False

    @property
    def end(self) -> int:
        """Pages from the root to the end of this node."""
        return self.start + len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return (
            f"TreeNode(start={self.start}, pages={len(self.keys)}, live_swa={self.live_swa}, "
            f"full_lock={self.full_lock}, children={len(self.children)})"
        )


@dataclass(frozen=True)
class MatchResult:
    prefix_len: int  # tokens, multiple of page_size, window-safe
    full_pages: tuple[int, ...]  # one per page of the prefix
    swa_pages: tuple[int | None, ...]  # one per page; live ids on the window tail only, None
    #                                    before it (those are not locked: never hold them)
    node: TreeNode  # handle for lock/unlock (the root when prefix_len == 0)
    present_len: int = 0  # tokens of the input present in the tree, window-safe
    #                                    or not (>= prefix_len): the input branches off there.
    #                                    Keeping SWA for the W tokens before it makes that
    #                                    branch point matchable after insert.


class TreeState(Protocol):
    """The SWA radix tree's state, as the parts beside it read it (eviction.py, check.py):
    SWARadixTree is the one implementation; the Protocol keeps them below the tree."""

    root: TreeNode
    num_nodes: int  # non-root nodes
    nodes_max: int
    full_pool: PagePool
    swa_pool: PagePool
    tail_max: int  # pages in a full window tail
    full_lru: OrderedDict[TreeNode, None]  # oldest first; a parent after its children
    swa_lru: OrderedDict[TreeNode, None]  # the nodes with live SWA, in the same order
    full_owned: set[int]
    swa_owned: set[int]
    spare_owner: dict[int, TreeNode]  # spare SWA page id -> node holding it, oldest first
    handles: Counter[TreeNode]  # outstanding lock() calls per node

    def tail(self, end_page: int) -> int:
        """Pages of the window tail of a prefix of end_page pages."""
        ...

    def live_run_at(self, node: TreeNode, upto: int, cap: int) -> int:
        """Consecutive live SWA pages ending just before page `upto` of node, up to cap."""
        ...
