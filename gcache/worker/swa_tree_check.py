"""check_integrity of the SWA radix tree: recompute every invariant from scratch."""
from __future__ import annotations

from collections import Counter


def check_tree(tree, external_full=None, external_swa=None) -> None:
    nodes = _walk_nodes(tree)
    assert len(nodes) == tree.num_nodes <= tree.nodes_max, \
        f"node count {len(nodes)} vs recorded {tree.num_nodes}, limit {tree.nodes_max}"
    _check_shape(tree, nodes)
    _check_locks(tree, nodes)
    _check_lru(tree, nodes)
    _check_ownership(tree, nodes, external_full, external_swa)


def _walk_nodes(tree) -> list:
    root = tree.root
    assert root.parent is None and not root.keys and not root.removed and root.full_lock == 0
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        assert len(out) <= tree.nodes_max, "tree has more nodes than its limit (or a cycle)"
        out.append(node)
        stack.extend(node.children.values())
    return out


def _check_shape(tree, nodes) -> None:
    key_bytes = 8 * tree.page_size
    for node in nodes:
        assert not node.removed, "a removed node is still linked"
        n = len(node.keys)
        assert n >= 1, "empty node"
        assert len(node.full) == len(node.swa) == len(node.swa_locks) == n, "per-page lists disagree"
        assert all(len(k) == key_bytes for k in node.keys), "page key of the wrong size"
        assert node.parent.children.get(node.keys[0]) is node, "child not indexed by its first page"
        assert node.start == node.parent.end, f"node start {node.start} != parent end {node.parent.end}"
        assert node.live_swa == sum(s is not None for s in node.swa), "live SWA count is stale"
        if not node.children:
            need = tree._tail(node.end)
            assert node.swa[-1] is not None, "a leaf ends in an SWA tombstone"
            assert tree._live_run_at(node, n, need) >= need, "a leaf does not end window-safe"


def _check_locks(tree, nodes) -> None:
    full = Counter()
    swa = Counter()  # (node id, page index) -> count
    for handle, count in tree._handles.items():
        assert count > 0 and not handle.removed, "lock handle on a removed node"
        n = handle
        while n is not tree.root:
            full[id(n)] += count
            n = n.parent
        n, left = handle, tree._tail(handle.end)
        while left > 0:
            for j in range(len(n) - 1, -1, -1):
                swa[(id(n), j)] += count
                left -= 1
                if not left:
                    break
            n = n.parent
    for node in nodes:
        assert node.full_lock == full[id(node)], f"full lock {node.full_lock} != {full[id(node)]} from handles"
        for j, c in enumerate(node.swa_locks):
            assert c == swa[(id(node), j)], "SWA lock count disagrees with the handles"
            assert c <= node.full_lock, "SWA lock exceeds the full lock"
            assert c == 0 or node.swa[j] is not None, "an SWA-locked page has no live SWA"


def _check_lru(tree, nodes) -> None:
    assert set(tree._full_lru) == set(nodes), "full LRU does not hold exactly the tree's nodes"
    assert set(tree._swa_lru) == {n for n in nodes if n.live_swa}, "SWA LRU != nodes with live SWA"
    pos = {node: i for i, node in enumerate(tree._full_lru)}
    for node in nodes:
        if node.parent is not tree.root:
            assert pos[node] < pos[node.parent], "a parent is older than its child in the LRU"
    swa_pos = [pos[n] for n in tree._swa_lru]
    assert swa_pos == sorted(swa_pos), "SWA LRU order disagrees with the full LRU order"


def _check_ownership(tree, nodes, external_full, external_swa) -> None:
    for kind, pool, owned, ext in (("full", tree.full_pool, tree._full_owned, external_full),
                                   ("swa", tree.swa_pool, tree._swa_owned, external_swa)):
        pool.check_integrity()
        pages = [p for n in nodes for p in (n.full if kind == "full" else n.swa) if p is not None]
        assert len(pages) == len(set(pages)), f"a {kind} page is owned by two tree positions"
        assert set(pages) == owned, f"tree's {kind} ownership set is stale"
        assert all(pool.is_allocated(p) for p in pages), f"tree holds a free {kind} page"
        if ext is not None:
            ext = list(ext)
            assert len(ext) == len(set(ext)), f"an external {kind} page is listed twice"
            assert not owned & set(ext), f"a {kind} page is owned by the tree and outside it"
            allocated = {p for p in range(pool.num_pages) if pool.is_allocated(p)}
            assert allocated == owned | set(ext), \
                f"{kind} pool: {len(allocated - owned - set(ext))} leaked pages, " \
                f"{len((owned | set(ext)) - allocated)} owned but free"
