"""SWA-aware radix tree over token pages: window-safe match, dual locks, two-phase eviction.

Each node is an edge of one or more pages; per page it holds a full-pool page id and an
SWA-pool page id or an SWA tombstone (None). A prefix of P pages is usable (window-safe)
when the pages covering the W tokens before P all hold live SWA KV (swa_window.py).

Page keys are the SGLang HiCache page-hash chain (gcache.wire.keys): a page's key names its
whole prefix, so a node's keys are also its pages' L2 and L3 keys (with a KeyBuilder suffix).

Beyond SGLang's SWARadixCache: tombstones are per page, not per node, and a match may end
at any page, so a tombstone inside a branch's last W tokens only cuts the match back to
the longest window-safe page before it instead of making the whole branch unmatchable
(MatchEnds.ANY_PAGE, the default; match_ends=MatchEnds.NODE_BOUNDARY plugs SGLang's rule in).

Invariants (check_integrity): every leaf ends window-safe (so no leaf is a tombstone);
full lock counts come from the outstanding lock handles, SWA lock counts are per page and
never exceed their node's full lock; every pool page is owned exactly once (tree, pool free
list or a named outside owner); in both LRU orders (oldest first) a parent comes after
every child, since any access to a child passes through it; node count <= nodes_max.

Spare SWA pages (the first-reuse fix): insert(spare=...) names pages whose SWA KV no
checkpoint needs (a request left them behind its window). The tree keeps them live, so a
later request that diverges inside that stretch still finds a window-safe point there, and
eviction frees them before anything else (swa_tree/eviction.py, tier "spare"); a page stops being
spare once a request resumes on it (lock). Spare pages are never demoted to L2 (on_evict
sees None for them): lower tiers keep SWA only for checkpoints.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

import numpy as np

from gcache.common.attention import AttentionKind
from gcache.serving.swa_window import tail_start_page
from gcache.wire.keys import page_hashes_array
from gcache.worker.integrity import require
from gcache.worker.kvcache.kv_pool import PagePool
from gcache.worker.kvcache.swa_tree.check import check_tree
from gcache.worker.kvcache.swa_tree.eviction import SWAEviction
from gcache.worker.kvcache.swa_tree.node import MatchEnds, MatchResult, TreeNode


class SWARadixTree:
    def __init__(
        self,
        page_size: int,
        window: int,
        full_pool: PagePool,
        swa_pool: PagePool,
        nodes_max: int = 1_000_000,
        match_ends: MatchEnds = MatchEnds.ANY_PAGE,
    ) -> None:
        for name, v in (("page_size", page_size), ("window", window), ("nodes_max", nodes_max)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.page_size = page_size
        self.window = window
        self.full_pool = full_pool
        self.swa_pool = swa_pool
        self.nodes_max = nodes_max
        if not isinstance(match_ends, MatchEnds):
            raise ValueError(f"match_ends must be a MatchEnds, got {match_ends!r}")
        self.match_ends = match_ends  # where match() may end (swa_tree/node.py: MatchEnds)
        self.root = TreeNode(None, 0, [], [], [])
        self.num_nodes = 0  # non-root nodes
        self.tail_max = -(-window // page_size)  # pages in a full window tail
        # Oldest first. A parent always sits after its children; swa_lru holds exactly the
        # nodes with live SWA, in the same relative order.
        self.full_lru: OrderedDict[TreeNode, None] = OrderedDict()
        self.swa_lru: OrderedDict[TreeNode, None] = OrderedDict()
        self.full_owned: set[int] = set()
        self.swa_owned: set[int] = set()
        # Tree-owned SWA page ids no checkpoint needs -> the node holding them, oldest first:
        # evicted first, in this order (so eviction never scans the tree for them).
        self.spare_owner: dict[int, TreeNode] = {}
        self.handles: Counter[TreeNode] = Counter()  # outstanding lock() calls per node
        # Called with (page keys, full page ids, swa page ids or None) just before eviction
        # frees them to the pools: the hierarchy demotes them to host memory (write_back).
        self.on_evict: Callable[[list, list, list], None] | None = None
        # Observers of which pages the tree holds (the router publisher), after on_evict:
        # obs.pages_stored(keys, swa_live) once pages or their SWA KV entered the tree,
        # obs.pages_evicted(keys, full_ids, swa_ids) like on_evict. Cheap, never touch the tree.
        self.observers: list = []
        self.eviction = SWAEviction(self)  # the two-phase eviction (swa_tree/eviction.py)

    # ---- public API ----------------------------------------------------------------
    def match(self, tokens, max_len: int | None = None, keys: list | None = None) -> MatchResult:
        """Longest window-safe, page-aligned prefix of `tokens`, at most `max_len` tokens
        (default len(tokens) - 1, so the caller always has a token left to compute).
        Moves the matched path to most-recent in both LRU orders. `keys` (the page-hash
        chain of tokens, at least its whole pages) saves hashing when the caller has it.
        The match ends at any window-safe page, or with MatchEnds.NODE_BOUNDARY only where
        the walk leaves a node (self.match_ends)."""
        keys = self._page_keys(tokens, aligned=False, keys=keys)
        any_page = self.match_ends is MatchEnds.ANY_PAGE
        if max_len is None:
            max_len = max(0, len(tokens) - 1)
        if not isinstance(max_len, (int, np.integer)) or max_len < 0:
            raise ValueError(f"max_len must be a non-negative int, got {max_len!r}")
        limit = min(len(keys), int(max_len) // self.page_size)
        node, i, run = self.root, 0, 0
        best_i, best_node, best_off = 0, self.root, 0
        bound_i, bound_node = 0, self.root  # best match ending on a node boundary
        while i < limit:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck, cs, j = child.keys, child.swa, 0
            while j < len(ck) and i < limit and ck[j] == keys[i]:
                run = run + 1 if cs[j] is not None else 0
                i, j = i + 1, j + 1
                if any_page and run >= self.tail(i):
                    best_i, best_node, best_off = i, child, j
            if not any_page and run >= self.tail(i):  # the one candidate: where the walk leaves child
                best_i, best_node, best_off = i, child, j
            if j < len(ck):
                break
            if best_i == i:
                bound_i, bound_node = i, child
            node = child
        handle = best_node
        if best_node is not self.root and best_off < len(best_node):
            if self.num_nodes < self.nodes_max:
                handle = self._split(best_node, best_off)
            else:  # no node left to split with: fall back to the best node boundary
                best_i, handle = bound_i, bound_node
        full, swa = self._path_pages(handle)
        require(len(full) == best_i, "matched path pages disagree with the match length")
        # Only the window tail is SWA-locked by lock(); SWA pages before it may be evicted
        # while the request runs, so the request must never hold their ids.
        swa[: tail_start_page(best_i, self.page_size, self.window)] = []
        swa[:0] = [None] * (best_i - len(swa))
        self._touch(handle)
        return MatchResult(best_i * self.page_size, tuple(full), tuple(swa), handle, i * self.page_size)

    def path_swa_pages(self, node) -> list:
        """SWA page ids (None: not live) of the path root..node, spare pages included: read-only
        and valid only until the next call that may evict (match() hides what lies before the
        window tail, for a request must never hold those ids)."""
        if node is None or node is self.root:
            return []
        self._check_handle(node)
        return self._path_pages(node)[1]

    def lock(self, node: TreeNode) -> None:
        """Full lock on root..node, SWA lock on the pages of node's window tail. Call it
        right after match() with that match's node."""
        self._check_handle(node)
        need = self.tail(node.end)
        if self.live_run_at(node, len(node), need) < need:
            raise ValueError("lock: the node's window tail has no live SWA KV (lock right after match)")
        n = node
        while n is not self.root:
            n.full_lock += 1
            n = n.parent
        self._add_swa_locks(node, need, +1)
        self.handles[node] += 1

    def unlock(self, node: TreeNode) -> None:
        if self.handles.get(node, 0) == 0:
            raise ValueError("unlock: node holds no lock")
        n = node
        while n is not self.root:
            n.full_lock -= 1
            n = n.parent
        self._add_swa_locks(node, self.tail(node.end), -1)
        self.handles[node] -= 1
        if not self.handles[node]:
            del self.handles[node]

    def insert(self, tokens, full_pages, swa_pages, keys: list | None = None, spare=()) -> int:
        """Cache a page-aligned sequence. The tree takes ownership of every page given:
        a page already cached at its position is freed back to its pool (unless it is the
        very page the tree holds), a live SWA page revives a tombstone there, and pages past
        the last window-safe point of a new branch are freed. `spare`: page indices whose
        SWA KV the caller needs for no checkpoint (kept, evicted first; a live non-spare
        page given where the tree holds a spare one makes it a checkpoint page).
        Returns full pages added."""
        keys = self._page_keys(tokens, aligned=True, keys=keys)
        spare = frozenset(spare)
        full_pages, swa_pages = list(full_pages), list(swa_pages)
        if len(full_pages) != len(keys) or len(swa_pages) != len(keys):
            raise ValueError(
                f"insert: {len(keys)} pages of tokens but {len(full_pages)} full and {len(swa_pages)} swa page ids"
            )
        self._check_page_ids(full_pages, swa_pages)
        segments, present, stop = self._walk(keys)
        self._check_ownership(segments, present, full_pages, swa_pages)
        free_full: list[int] = []
        free_swa: list[int] = []
        for node, j0, i0, n in segments:  # pages already in the tree: dedupe or revive
            for k in range(n):
                s = swa_pages[i0 + k]
                self._merge_page(node, j0 + k, full_pages[i0 + k], s, free_full, free_swa)
                held = node.swa[j0 + k]
                if s is not None and held is not None:
                    if i0 + k in spare and held == s:
                        self.spare_owner[held] = node
                    elif i0 + k not in spare:
                        self.spare_owner.pop(held, None)  # someone's checkpoint now
        last = segments[-1][0] if segments else self.root
        added = 0
        if present < len(keys):
            added, leaf = self._add_branch(keys, full_pages, swa_pages, present, stop, segments, free_full, free_swa)
            last = leaf or last
            if leaf is not None:
                for j, sp in enumerate(leaf.swa):
                    if sp is not None and present + j in spare:
                        self.spare_owner[sp] = leaf
        self.full_pool.free(free_full)
        self.swa_pool.free(free_swa)
        for node, _, _, _ in segments:  # a path node left as a leaf by the node-limit eviction
            self.eviction.settle(node, [0, 0])
        while last.removed:
            last = last.parent
        self._touch(last)
        return added

    def evict(self, full_pages_needed: int, swa_pages_needed: int) -> tuple[int, int]:
        """Free at least the given numbers of pages where unlocked ones allow; returns
        (full, swa) pages actually freed to the pools (SWAEviction.evict)."""
        return self.eviction.evict(full_pages_needed, swa_pages_needed)

    def check_integrity(self, external_full_pages=None, external_swa_pages=None) -> None:
        """Assert every invariant. With external_* (pages outside owners hold, e.g. running
        requests), also assert that each pool page is free, tree-owned or external, exactly
        once, so nothing leaks."""
        check_tree(self, external_full_pages, external_swa_pages)

    def cached_pages(self) -> tuple[int, int]:
        return len(self.full_owned), len(self.swa_owned)

    def spare_pages(self) -> int:
        """Live SWA pages the tree holds that no checkpoint needs (evicted first)."""
        return len(self.spare_owner)

    def checkpoints(self, tokens, keys: list | None = None) -> list[int]:
        """The window-safe points (tokens) on the cached path of `tokens`: the prefix lengths
        a request could resume at, i.e. the SWA checkpoints the tree keeps for this path (what
        a router publishes as window-safe prefix points). Read-only: no LRU touch."""
        keys = self._page_keys(tokens, aligned=False, keys=keys)
        node, i, run, out = self.root, 0, 0, []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            j = 0
            while j < len(child) and i < len(keys) and child.keys[j] == keys[i]:
                run = run + 1 if child.swa[j] is not None else 0
                i, j = i + 1, j + 1
                if run >= self.tail(i):
                    out.append(i * self.page_size)
            if j < len(child):
                break
            node = child
        return out

    def node_keys(self, node: TreeNode) -> list:
        """The page-hash chain root..node (one key per page)."""
        chain = []
        while node is not self.root:
            chain.append(node.keys)
            node = node.parent
        return [k for keys in reversed(chain) for k in keys]

    def evicting(self, keys: list, full_ids: list, swa_ids: list) -> None:
        """Pages are about to leave (full id given) or lose their SWA KV (full id None).
        Spare SWA is not demoted (lower tiers keep checkpoint SWA only)."""
        if self.on_evict is not None:
            demote = [None if s in self.spare_owner else s for s in swa_ids] if self.spare_owner else swa_ids
            if any(f is not None for f in full_ids) or any(s is not None for s in demote):
                self.on_evict(keys, full_ids, demote)
        for obs in self.observers:
            obs.pages_evicted(keys, full_ids, swa_ids)

    # ---- walking ---------------------------------------------------------------------
    def _page_keys(self, tokens, aligned: bool, keys: list | None = None) -> list[str]:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape}")
        if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0):
            raise ValueError("tokens must be non-negative ints")
        if aligned and arr.size % self.page_size:
            raise ValueError(f"insert: {arr.size} tokens is not a multiple of page_size {self.page_size}")
        n = arr.size // self.page_size
        if keys is not None:
            if len(keys) < n:
                raise ValueError(f"{len(keys)} page keys given for {n} pages of tokens")
            return list(keys[:n])
        return page_hashes_array(arr[: n * self.page_size], self.page_size)

    def _walk(self, keys: list[str]):
        """Follow keys down the tree: segments (node, first page in node, first key index,
        pages), pages present, and where it stopped: (node, offset) of the divergence."""
        node, i = self.root, 0
        segments: list[tuple[TreeNode, int, int, int]] = []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                return segments, i, (node, len(node))
            j = 0
            while j < len(child) and i + j < len(keys) and child.keys[j] == keys[i + j]:
                j += 1
            segments.append((child, 0, i, j))
            i += j
            if j < len(child):
                return segments, i, (child, j)
            node = child
        return segments, i, (node, len(node))

    def tail(self, end_page: int) -> int:
        # == end_page - tail_start_page(end_page, ...): every page while the prefix is
        # shorter than the window, then ceil(W / ps) pages
        return end_page if end_page < self.tail_max else self.tail_max

    def live_run_at(self, node: TreeNode, upto: int, cap: int) -> int:
        """Consecutive live SWA pages ending just before page `upto` of node, up to cap."""
        run, n, j = 0, node, upto
        while n is not self.root and run < cap:
            swa = n.swa
            while j > 0:
                j -= 1
                if swa[j] is None:
                    return run
                run += 1
                if run >= cap:
                    return run
            n = n.parent
            j = len(n)
        return run

    def last_safe_offset(self, node: TreeNode, swa: list) -> int:
        """Largest k <= len(swa) such that the path ending at page k of `node` (with page
        SWA states `swa`) is window-safe; 0 if none."""
        return self._last_safe_offset_at(node.parent, len(node.parent.keys), node.start, swa)

    def _path_pages(self, node: TreeNode) -> tuple[list, list]:
        chain = []
        while node is not self.root:
            chain.append(node)
            node = node.parent
        full, swa = [], []
        for n in reversed(chain):
            full.extend(n.full)
            swa.extend(n.swa)
        return full, swa

    def _touch(self, node: TreeNode) -> None:
        """Most-recent for node and its ancestors, the root side last (parents after children)."""
        while node is not self.root:
            self.full_lru.move_to_end(node)
            if node.live_swa:
                self.swa_lru.move_to_end(node)
            node = node.parent

    def _check_handle(self, node) -> None:
        if not isinstance(node, TreeNode) or node.removed:
            raise ValueError("not a live node of this tree (was it evicted before lock?)")
        n = node
        while n.parent is not None:
            n = n.parent
        if n is not self.root:
            raise ValueError("node belongs to another tree")

    def _add_swa_locks(self, node: TreeNode, pages: int, delta: int) -> None:
        n = node
        while pages > 0:
            for j in range(len(n) - 1, -1, -1):
                n.swa_locks[j] += delta
                sp = n.swa[j]
                if delta > 0 and self.spare_owner and sp is not None:
                    self.spare_owner.pop(sp, None)  # a request resumed here: a checkpoint now
                require(n.swa_locks[j] >= 0, "SWA lock count went negative")
                pages -= 1
                if not pages:
                    break
            n = n.parent

    # ---- insert helpers --------------------------------------------------------------
    def _check_page_ids(self, full_pages: list, swa_pages: list) -> None:
        for kind, pages, pool, owned in (
            (AttentionKind.FULL, full_pages, self.full_pool, self.full_owned),
            (AttentionKind.SWA, swa_pages, self.swa_pool, self.swa_owned),
        ):
            ids = [p for p in pages if p is not None]
            if kind == AttentionKind.FULL and len(ids) != len(pages):
                raise ValueError("insert: every page needs a full-attention page id")
            for p in ids:
                if p in owned:  # allocated: the tree holds it (position checked later)
                    continue
                if not isinstance(p, (int, np.integer)) or not 0 <= p < pool.num_pages or not pool.is_allocated(p):
                    raise ValueError(f"insert: {kind} page {p!r} is not an allocated page of the {kind} pool")
            if len(set(ids)) != len(ids):
                raise ValueError(f"insert: a {kind} page id is listed twice")

    def _check_ownership(self, segments, present: int, full_pages: list, swa_pages: list) -> None:
        """A page the tree owns may only be handed back at the position the tree holds it."""
        fo, so = self.full_owned, self.swa_owned
        for node, j0, i0, n in segments:
            nf, ns = node.full, node.swa
            for k in range(n):
                f, s = full_pages[i0 + k], swa_pages[i0 + k]
                if f != nf[j0 + k] and f in fo:
                    raise ValueError(f"insert: full page {f} is owned by the tree at another position")
                if s is not None and s != ns[j0 + k] and s in so:
                    raise ValueError(f"insert: swa page {s} is owned by the tree at another position")
        for f, s in zip(full_pages[present:], swa_pages[present:]):
            if f in fo or (s is not None and s in so):
                raise ValueError(f"insert: page {f}/{s} is owned by the tree at another position")

    def _merge_page(self, node: TreeNode, j: int, f: int, s, free_full: list, free_swa: list) -> None:
        if f != node.full[j]:
            free_full.append(f)
        if s is None or s == node.swa[j]:
            return
        if node.swa[j] is None:  # revive the tombstone with the request's live SWA KV
            node.swa[j] = s
            self.swa_owned.add(s)
            node.live_swa += 1
            for obs in self.observers:
                obs.pages_stored([node.keys[j]], [True])
            if node.live_swa == 1:
                self.swa_lru[node] = None  # placed by the _touch that ends insert
        else:
            free_swa.append(s)

    def _add_branch(self, keys, full_pages, swa_pages, present, stop, segments, free_full, free_swa):
        """New leaf for keys[present:], cut to its last window-safe page: (pages added, leaf);
        (0, None) if no page of it is window-safe or no node is left for it."""
        node, off = stop
        new_swa = swa_pages[present:]
        keep = self._last_safe_offset_at(node, off, present, new_swa)
        needed = 1 + (0 < off < len(node))
        if keep and self.num_nodes + needed > self.nodes_max:
            self.eviction.evict_nodes(self.num_nodes + needed - self.nodes_max, {s[0] for s in segments})
        if not keep or self.num_nodes + needed > self.nodes_max:
            keep = 0
        free_full.extend(full_pages[present + keep :])
        free_swa.extend(s for s in new_swa[keep:] if s is not None)
        if not keep:
            return 0, None
        parent = self._split(node, off) if off < len(node) else node
        leaf = TreeNode(
            parent, present, keys[present : present + keep], full_pages[present : present + keep], new_swa[:keep]
        )
        parent.children[leaf.keys[0]] = leaf
        self.num_nodes += 1
        self.full_lru[leaf] = None
        if leaf.live_swa:
            self.swa_lru[leaf] = None
        self.full_owned.update(leaf.full)
        self.swa_owned.update(s for s in leaf.swa if s is not None)
        for obs in self.observers:
            obs.pages_stored(leaf.keys, [s is not None for s in leaf.swa])
        return keep, leaf

    def _last_safe_offset_at(self, node: TreeNode, off: int, start: int, swa: list) -> int:
        """The same for pages `swa` hung below page `off` of node, starting at page `start`."""
        run = self.live_run_at(node, off, self.tail_max) if node is not self.root else 0
        best = 0
        for j, s in enumerate(swa):
            run = run + 1 if s is not None else 0
            if run >= self.tail(start + j + 1):
                best = j + 1
        return best

    # ---- structure ---------------------------------------------------------------------
    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut node after k pages. The existing object keeps the lower part (so lock handles
        keep their end); returns the new upper node. Caller touches a path through it."""
        require(0 < k < len(node) and self.num_nodes < self.nodes_max, "split outside the node or past nodes_max")
        upper = TreeNode(node.parent, node.start, node.keys[:k], node.full[:k], node.swa[:k])
        upper.swa_locks = node.swa_locks[:k]
        upper.full_lock = node.full_lock
        for sp in upper.swa:  # spare pages now held by the upper part
            if sp is not None and sp in self.spare_owner:
                self.spare_owner[sp] = upper
        node.parent.children[node.keys[0]] = upper
        for lst in (node.keys, node.full, node.swa, node.swa_locks):
            del lst[:k]
        node.start += k
        node.live_swa -= upper.live_swa
        node.parent = upper
        upper.children[node.keys[0]] = node
        self.num_nodes += 1
        self.full_lru[upper] = None
        if upper.live_swa:
            self.swa_lru[upper] = None
        if not node.live_swa:
            self.swa_lru.pop(node, None)
        return upper
