"""SWA-aware radix tree: one test per rule, then a random workload against two oracles
(a brute-force window-safe match over a flat dict of the tree's pages, and simulated KV
contents that catch any page the tree hands out for the wrong tokens)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcache.serving.checkpoints import CheckpointRule
from gcache.serving.swa_window import tail_pages, tail_start_page
from gcache.worker.kvcache.kv_pool import PagePool
from gcache.worker.kvcache.swa_tree.tree import SWARadixTree

PS = 4


def make_tree(window=16, full=64, swa=64, nodes_max=1000):
    return SWARadixTree(PS, window, PagePool(full, "full"), PagePool(swa, "swa"), nodes_max)


def seq(tag: int, pages: int, start: int = 0) -> list[int]:
    """Page k of sequence `tag` has tokens [tag*1000 + k*10 + 0..3]."""
    return [tag * 1000 + k * 10 + t for k in range(start, start + pages) for t in range(PS)]


def put(tree, tokens, live=None):
    """Insert tokens with fresh pages; live: page indices given SWA KV (default all)."""
    n = len(tokens) // PS
    full = tree.full_pool.alloc(n)
    live = range(n) if live is None else live
    swa = [tree.swa_pool.alloc(1)[0] if i in live else None for i in range(n)]
    return tree.insert(tokens, full, swa)


def snapshot(tree):
    return tree.cached_pages(), tree.full_pool.num_free, tree.swa_pool.num_free, tree.num_nodes


# ---- window arithmetic ---------------------------------------------------------------------
def test_tail_pages_cover_the_w_tokens_before_the_match_point():
    assert tail_start_page(10, 16, 128) == 2 and tail_pages(10, 16, 128) == 8
    assert tail_pages(3, 16, 128) == 3  # short prefix: every page
    assert tail_pages(10, 4, 10) == 3  # W not a multiple of the page: round out
    assert CheckpointRule(4).keep_pages(12, 8) == {10, 11}
    assert CheckpointRule(4).keep_pages(12, 8, ends=[5]) == {3, 4, 10, 11}
    assert CheckpointRule(4, every=4).keep_pages(12, 8) == {2, 3, 6, 7, 10, 11}


# ---- match ----------------------------------------------------------------------------------
def test_match_leaves_a_token_to_compute_and_honours_max_len():
    tree = make_tree()
    s = seq(1, 6)
    assert put(tree, s) == 6
    assert tree.match(s).prefix_len == 20  # whole input cached, default keeps one token
    assert tree.match(s, max_len=24).prefix_len == 24
    assert tree.match(s, max_len=9).prefix_len == 8
    m = tree.match(s + [7, 7])  # partial trailing page is ignored
    assert m.prefix_len == 24 and m.present_len == 24 and len(m.full_pages) == 6
    assert tree.match(seq(2, 6)).prefix_len == 0
    tree.check_integrity([], [])


def test_tombstone_in_last_window_cuts_back_to_longest_safe_prefix_not_zero():
    # W = 16 tokens = 4 pages. Page 9 of a 12-page branch has no SWA KV: the branch may end
    # no later than page 9 (pages 5..8 live). A node-granular tree (SGLang) would drop the
    # whole single-node branch; we keep and match the 9 safe pages.
    tree = make_tree()
    s = seq(1, 12)
    assert put(tree, s, live=set(range(12)) - {9}) == 9
    assert tree.match(s + [0]).prefix_len == 36
    assert tree.cached_pages() == (9, 9)
    assert tree.full_pool.num_free == 64 - 9 and tree.swa_pool.num_free == 64 - 9
    tree.check_integrity([], [])


def test_tombstone_before_the_window_does_not_matter():
    tree = make_tree()
    s = seq(1, 12)
    put(tree, s)
    assert tree.evict(0, 1) == (0, 1)  # frees the head page's SWA (page 0)
    # diverge after page 5: prefix of 5 pages needs pages 1..4 only
    assert tree.match(s[:20] + seq(9, 2)).prefix_len == 20
    assert tree.match(s[:16] + seq(9, 2)).prefix_len == 0  # needs page 0
    assert tree.match(s + [0]).prefix_len == 48
    tree.check_integrity([], [])


def test_match_mid_node_splits_and_reports_where_input_branches_off():
    tree = make_tree()
    s = seq(1, 8)
    put(tree, s)
    m = tree.match(s[:20] + seq(9, 3))
    assert m.prefix_len == 20 and m.present_len == 20
    assert tree.num_nodes == 2 and m.node.end == 5
    put(tree, s[:20] + seq(9, 3))  # branch at page 5
    assert tree.num_nodes == 3
    tree.check_integrity([], [])


def test_match_without_node_budget_falls_back_to_node_boundary():
    tree = make_tree(nodes_max=1)
    s = seq(1, 8)
    put(tree, s)
    m = tree.match(s[:20] + seq(9, 3))
    assert m.prefix_len == 0 and tree.num_nodes == 1
    assert m.present_len == 20


# ---- insert: ownership, duplicates, revival -------------------------------------------------
def test_insert_frees_duplicates_and_revives_tombstones():
    tree = make_tree()
    s = seq(1, 12)
    put(tree, s)
    tree.evict(0, 8)  # tier 0: SWA of pages 0..7
    assert tree.cached_pages() == (12, 4)
    assert tree.match(s[:24] + seq(9, 1)).prefix_len == 0
    full = tree.full_pool.alloc(12)
    swa = tree.swa_pool.alloc(12)
    free_f, free_s = tree.full_pool.num_free, tree.swa_pool.num_free
    assert tree.insert(s, full, swa) == 0
    # 12 duplicate full pages and 4 duplicate SWA pages come back; 8 SWA pages revive
    assert tree.full_pool.num_free == free_f + 12 and tree.swa_pool.num_free == free_s + 4
    m = tree.match(s[:24] + seq(9, 1))
    assert m.prefix_len == 24 and m.swa_pages == (None, None) + tuple(swa[2:6])  # tail only
    tree.check_integrity([], [])


def test_insert_accepts_the_trees_own_pages_back_at_their_position():
    tree = make_tree()
    s = seq(1, 4)
    put(tree, s)
    m = tree.match(s, max_len=16)
    tree.lock(m.node)
    own_full = tree.full_pool.alloc(2)
    own_swa = tree.swa_pool.alloc(2)
    s2 = s + seq(1, 2, 4)
    assert tree.insert(s2, list(m.full_pages) + own_full, list(m.swa_pages) + own_swa) == 2
    tree.unlock(m.node)
    assert tree.cached_pages() == (6, 6)
    tree.check_integrity([], [])


@pytest.mark.parametrize(
    "case", ["misaligned", "negative", "unallocated", "dup", "owned_elsewhere", "length", "missing_full"]
)
def test_bad_insert_raises_and_changes_nothing(case):
    tree = make_tree()
    s = seq(1, 4)
    put(tree, s)
    owned_full = tree.match(s, max_len=16).full_pages
    full, swa = tree.full_pool.alloc(2), tree.swa_pool.alloc(2)
    before = snapshot(tree)
    toks, f, w = seq(2, 2), list(full), list(swa)
    if case == "misaligned":
        toks = toks[:-1]
    elif case == "negative":
        toks[0] = -1
    elif case == "unallocated":
        f[0] = 63
    elif case == "dup":
        w[1] = w[0]
    elif case == "owned_elsewhere":
        f[0] = owned_full[0]
    elif case == "length":
        f = f[:1]
    elif case == "missing_full":
        f[1] = None
    with pytest.raises(ValueError):
        tree.insert(toks, f, w)
    assert snapshot(tree) == before
    tree.check_integrity(full, swa)


# ---- locks --------------------------------------------------------------------------------
def test_locks_protect_full_path_and_swa_window_tail():
    tree = make_tree()
    s = seq(1, 12)
    put(tree, s)
    m = tree.match(s + [0])
    tree.lock(m.node)
    tree.check_integrity([], [])
    assert tree.evict(100, 100) == (0, 8)  # only SWA outside the 4-page tail can go
    assert tree.match(s + [0]).prefix_len == 48
    tree.unlock(m.node)
    assert tree.evict(100, 100) == (12, 4)
    assert tree.cached_pages() == (0, 0) and tree.num_nodes == 0
    assert tree.full_pool.num_free == 64 and tree.swa_pool.num_free == 64
    with pytest.raises(ValueError):
        tree.unlock(m.node)
    with pytest.raises(ValueError):
        tree.lock(m.node)  # evicted node


def test_split_of_a_locked_node_keeps_lock_counts_exact():
    tree = make_tree()
    s = seq(1, 10)
    put(tree, s)
    m = tree.match(s + [0])
    tree.lock(m.node)
    put(tree, s[:12] + seq(5, 4))  # splits the locked node at page 3
    tree.check_integrity([], [])
    tree.unlock(m.node)
    tree.check_integrity([], [])
    assert tree.evict(100, 100)[0] == 14 and tree.num_nodes == 0


# ---- eviction order -----------------------------------------------------------------------
def test_full_phase_evicts_least_recent_leaf_first():
    tree = make_tree()
    a, b = seq(1, 6), seq(2, 6)
    put(tree, a)
    put(tree, b)
    tree.match(a + [0])  # a is now the most recent
    assert tree.evict(1, 0) == (6, 6)
    assert tree.match(a + [0]).prefix_len == 24 and tree.match(b + [0]).prefix_len == 0
    tree.check_integrity([], [])


def test_swa_phase_frees_far_pages_then_stale_ends_then_oldest_live_tail():
    tree = make_tree()
    c = seq(3, 6)
    put(tree, c)  # oldest branch
    t1 = seq(1, 8)
    put(tree, t1)
    t2 = t1 + seq(1, 8, 8)
    put(tree, t2)  # turn 2 extends turn 1: t1's end is stale
    # tier 0: c pages 0..1, t2-leaf pages 8..11, t1 pages 0..3 (10 pages)
    assert tree.evict(0, 10) == (0, 10)
    assert tree.match(c + [0]).prefix_len == 24 and tree.match(t2 + [0]).prefix_len == 64
    assert tree.match(t1 + [0]).prefix_len == 32
    # tier 1: the stale end of turn 1 (its 4 tail pages) goes before any live tail
    assert tree.evict(0, 1) == (0, 4)
    assert tree.match(t1 + seq(8, 1)).prefix_len == 0
    assert tree.match(c + [0]).prefix_len == 24 and tree.match(t2 + [0]).prefix_len == 64
    # tier 2: the least recent live branch goes whole (full KV is useless without SWA)
    assert tree.evict(0, 1) == (6, 4)
    assert tree.match(c + [0]).prefix_len == 0 and tree.match(t2 + [0]).prefix_len == 64
    tree.check_integrity([], [])


def test_node_limit_evicts_lru_leaf_or_skips_insert_when_all_locked():
    tree = make_tree(nodes_max=2)
    a, b, c = seq(1, 3), seq(2, 3), seq(3, 3)
    put(tree, a)
    put(tree, b)
    put(tree, c)  # evicts a
    assert tree.num_nodes == 2 and tree.match(a).prefix_len == 0
    locks = [tree.match(x + [0]).node for x in (b, c)]
    for n in locks:
        tree.lock(n)
    free_before = tree.full_pool.num_free
    assert put(tree, seq(4, 3)) == 0  # no room: its pages go back
    assert tree.full_pool.num_free == free_before
    for n in locks:
        tree.unlock(n)
    tree.check_integrity([], [])


def test_evict_rejects_bad_counts():
    tree = make_tree()
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError):
            tree.evict(bad, 0)


# ---- random workload against oracles --------------------------------------------------------
def flat_pages(tree):
    """{tuple of page keys from the root: swa-live} for every cached page."""
    out, stack = {}, [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for k, s in zip(node.keys, node.swa):
            path = path + (k,)
            out[path] = s is not None
        stack.extend((c, path) for c in node.children.values())
    return out


def oracle_match(tree, flat, tokens, max_len):
    keys = tree._page_keys(tokens, aligned=False)
    limit = min(len(keys), max_len // PS)
    best = 0
    for p in range(1, limit + 1):
        if tuple(keys[:p]) not in flat:
            break
        lo = tail_start_page(p, PS, tree.window)
        if all(flat[tuple(keys[: i + 1])] for i in range(lo, p)):
            best = p
    return best


class Workload:
    """Requests over sequences that share prefixes, run like the engine would run them."""

    def __init__(self, rng: random.Random, window: int, full: int, swa: int, nodes_max: int):
        self.rng = rng
        self.tree = SWARadixTree(PS, window, PagePool(full, "full"), PagePool(swa, "swa"), nodes_max)
        self.content_full: dict[int, tuple] = {}  # simulated KV: page id -> tokens it encodes
        self.content_swa: dict[int, tuple] = {}
        self.running: list[dict] = []

    def tokens(self) -> list[int]:
        pages = self.rng.randint(1, 9)
        out = []
        for k in range(pages):
            variant = 0 if self.rng.random() < 0.75 else self.rng.randint(1, 3)
            out += [variant * 100 + k * 5 + t for t in range(PS)]
        return out + [7] * self.rng.randint(0, PS - 1)

    def check_match(self, m, tokens):
        for i, f in enumerate(m.full_pages):
            assert self.content_full[f] == tuple(tokens[: (i + 1) * PS]), "full page holds other tokens"
        for i, s in enumerate(m.swa_pages):
            if s is not None:
                assert self.content_swa[s] == tuple(tokens[: (i + 1) * PS]), "swa page holds other tokens"
        p = m.prefix_len // PS
        assert all(m.swa_pages[i] is not None for i in range(tail_start_page(p, PS, self.tree.window), p))

    def start(self):
        tree, tokens = self.tree, self.tokens()
        flat, room = flat_pages(tree), tree.num_nodes < tree.nodes_max
        m = tree.match(tokens)
        want = oracle_match(tree, flat, tokens, max(0, len(tokens) - 1))
        assert m.prefix_len // PS == want if room else m.prefix_len // PS <= want
        self.check_match(m, tokens)
        tree.lock(m.node)
        n, done = len(tokens) // PS, m.prefix_len // PS
        if self.rng.random() < 0.5:
            keep = set(range(n))
        else:
            keep = CheckpointRule(PS, self.rng.choice([0, 3])).keep_pages(n, tree.window, [m.present_len // PS])
        new_swa = [i for i in range(done, n) if i in keep]
        f_need, s_need = n - done, len(new_swa)
        short_f = max(0, f_need - tree.full_pool.num_free)
        short_s = max(0, s_need - tree.swa_pool.num_free)
        if short_f or short_s:
            tree.evict(short_f, short_s)
        full = tree.full_pool.alloc(f_need)
        swa = tree.swa_pool.alloc(s_need) if full is not None else None
        if swa is None:
            if full is not None:
                tree.full_pool.free(full)
            tree.unlock(m.node)
            return
        swa_by_page = dict(zip(new_swa, swa))
        for i in range(done, n):  # "compute" the KV of the new pages
            self.content_full[full[i - done]] = tuple(tokens[: (i + 1) * PS])
            if i in swa_by_page:
                self.content_swa[swa_by_page[i]] = tuple(tokens[: (i + 1) * PS])
        self.running.append(
            dict(
                tokens=tokens[: n * PS],
                node=m.node,
                full=list(m.full_pages) + full,
                swa=list(m.swa_pages) + [swa_by_page.get(i) for i in range(done, n)],
                own_full=full,
                own_swa=swa,
            )
        )

    def finish(self):
        if not self.running:
            return
        r = self.running.pop(self.rng.randrange(len(self.running)))
        self.tree.insert(r["tokens"], r["full"], r["swa"])
        self.tree.unlock(r["node"])

    def evict(self):
        self.tree.evict(self.rng.randint(0, 6), self.rng.randint(0, 6))

    def check(self):
        ext_f = [p for r in self.running for p in r["own_full"]]
        ext_s = [p for r in self.running for p in r["own_swa"]]
        self.tree.check_integrity(ext_f, ext_s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    ops=st.lists(st.sampled_from("ssffe"), min_size=1, max_size=80),
    window=st.sampled_from([4, 8, 10, 16]),
    pools=st.sampled_from([(12, 6), (24, 24), (40, 10)]),
    nodes_max=st.sampled_from([3, 1000]),
)
def test_random_workload_keeps_invariants_and_matches_oracle(seed, ops, window, pools, nodes_max):
    wl = Workload(random.Random(seed), window, pools[0], pools[1], nodes_max)
    for op in ops:
        {"s": wl.start, "f": wl.finish, "e": wl.evict}[op]()
        wl.check()
    while wl.running:
        wl.finish()
        wl.check()
    wl.tree.evict(10**6, 10**6)
    wl.check()
    assert wl.tree.cached_pages() == (0, 0) and wl.tree.num_nodes == 0
    assert wl.tree.full_pool.num_free == pools[0] and wl.tree.swa_pool.num_free == pools[1]
