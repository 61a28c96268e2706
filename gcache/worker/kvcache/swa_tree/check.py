"""check_integrity of the SWA radix tree: recompute every invariant from scratch."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from gcache.common.attention import AttentionKind
from gcache.worker.integrity import require

if TYPE_CHECKING:
    from gcache.worker.kvcache.swa_tree.node import TreeNode, TreeState


def check_tree(tree: TreeState, external_full=None, external_swa=None) -> None:
    nodes = _walk_nodes(tree)
    require(
        len(nodes) == tree.num_nodes <= tree.nodes_max,
        f"node count {len(nodes)} vs recorded {tree.num_nodes}, limit {tree.nodes_max}",
    )
    _check_shape(tree, nodes)
    _check_locks(tree, nodes)
    _check_lru(tree, nodes)
    _check_ownership(tree, nodes, external_full, external_swa)


def _walk_nodes(tree: TreeState) -> list[TreeNode]:
    root = tree.root
    require(
        root.parent is None and not root.keys and not root.removed and root.full_lock == 0, "integrity check failed"
    )
    out: list[TreeNode] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        require(len(out) <= tree.nodes_max, "tree has more nodes than its limit (or a cycle)")
        out.append(node)
        stack.extend(node.children.values())
    return out


def _check_shape(tree, nodes) -> None:
    key_chars = 64  # sha256 hex: the page-hash chain of gcache.wire.keys
    for node in nodes:
        require(not node.removed, "a removed node is still linked")
        n = len(node.keys)
        require(n >= 1, "empty node")
        require(len(node.full) == len(node.swa) == len(node.swa_locks) == n, "per-page lists disagree")
        require(all(isinstance(k, str) and len(k) == key_chars for k in node.keys), "page key is not a page hash")
        require(node.parent.children.get(node.keys[0]) is node, "child not indexed by its first page")
        require(node.start == node.parent.end, f"node start {node.start} != parent end {node.parent.end}")
        require(node.live_swa == sum(s is not None for s in node.swa), "live SWA count is stale")
        if not node.children:
            need = tree.tail(node.end)
            require(node.swa[-1] is not None, "a leaf ends in an SWA tombstone")
            require(tree.live_run_at(node, n, need) >= need, "a leaf does not end window-safe")


def _check_locks(tree, nodes) -> None:
    full: Counter[int] = Counter()
    swa: Counter[tuple[int, int]] = Counter()  # (node id, page index) -> count
    for handle, count in tree.handles.items():
        require(count > 0 and not handle.removed, "lock handle on a removed node")
        n = handle
        while n is not tree.root:
            full[id(n)] += count
            n = n.parent
        n, left = handle, tree.tail(handle.end)
        while left > 0:
            for j in range(len(n) - 1, -1, -1):
                swa[(id(n), j)] += count
                left -= 1
                if not left:
                    break
            n = n.parent
    for node in nodes:
        require(node.full_lock == full[id(node)], f"full lock {node.full_lock} != {full[id(node)]} from handles")
        for j, c in enumerate(node.swa_locks):
            require(c == swa[(id(node), j)], "SWA lock count disagrees with the handles")
            require(c <= node.full_lock, "SWA lock exceeds the full lock")
            require(c == 0 or node.swa[j] is not None, "an SWA-locked page has no live SWA")


def _check_lru(tree, nodes) -> None:
    require(set(tree.full_lru) == set(nodes), "full LRU does not hold exactly the tree's nodes")
    require(set(tree.swa_lru) == {n for n in nodes if n.live_swa}, "SWA LRU != nodes with live SWA")
    pos = {node: i for i, node in enumerate(tree.full_lru)}
    for node in nodes:
        if node.parent is not tree.root:
            require(pos[node] < pos[node.parent], "a parent is older than its child in the LRU")
    swa_pos = [pos[n] for n in tree.swa_lru]
    require(swa_pos == sorted(swa_pos), "SWA LRU order disagrees with the full LRU order")


def _check_ownership(tree, nodes, external_full, external_swa) -> None:
    for kind, pool, owned, ext in (
        (AttentionKind.FULL, tree.full_pool, tree.full_owned, external_full),
        (AttentionKind.SWA, tree.swa_pool, tree.swa_owned, external_swa),
    ):
        pool.check_integrity()
        pages = [p for n in nodes for p in (n.full if kind == AttentionKind.FULL else n.swa) if p is not None]
        require(len(pages) == len(set(pages)), f"a {kind} page is owned by two tree positions")
        require(set(pages) == owned, f"tree's {kind} ownership set is stale")
        if kind == AttentionKind.SWA:
            require(set(tree.spare_owner) <= owned, "a spare SWA page is not one the tree holds")
            require(
                all(not n.removed and p in n.swa for p, n in tree.spare_owner.items()), "a spare page's node is stale"
            )
        require(all(pool.is_allocated(p) for p in pages), f"tree holds a free {kind} page")
        if ext is not None:
            ext = list(ext)
            require(len(ext) == len(set(ext)), f"an external {kind} page is listed twice")
            require(not owned & set(ext), f"a {kind} page is owned by the tree and outside it")
            allocated = {p for p in range(pool.num_pages) if pool.is_allocated(p)}
            require(
                allocated == owned | set(ext),
                f"{kind} pool: {len(allocated - owned - set(ext))} leaked pages, "
                f"{len((owned | set(ext)) - allocated)} owned but free",
            )
