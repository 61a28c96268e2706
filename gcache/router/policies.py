"""Routing policies: each scores the candidate workers for one prompt; the highest score wins,
ties go to the higher rendezvous rank (a hash of URL and prompt, the same on every router).

  cache_aware  the seed's score: match_weight * window-safe match % (tier-weighted) - load / max
               load, with sgl-router's imbalance guard (above it: least load).
  cache_ttft   lowest estimated TTFT: this request's uncached tokens (window-safe, tier-weighted)
               plus the worker's queued uncached tokens and running requests (CacheTTFT).
  dynamo       Dynamo's KV-router cost, SWA-unaware: overlap_weight * prefill_blocks +
               decode_blocks, overlap = raw run of cached full pages (SWA ignored).
  approx_tree  sgl-router's cache_aware, SWA-unaware: a per-worker approximate prefix index of
               the prompts this router sent, no engine feedback (its launcher's defaults).
  least_load, round_robin, random.
"""

from __future__ import annotations

import enum
import hashlib
import random as _random
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gcache.router.config import RouterConfig, RouterPolicy
from gcache.router.match import TierMatch, match_worker
from gcache.router.recent import RecentPrompts
from gcache.serving.redis_layout import Registration
from gcache.serving.tiers import Tier


@dataclass
class Candidate:
    url: str
    rank: int  # rendezvous tie-break, higher wins
    inflight: int = 0  # this router's requests in flight to it
    inflight_tokens: int = 0  # their prompt tokens (when the caller told begin())
    reg: Registration | None = None  # None: nothing published (static worker, Redis down)
    flags: Mapping[int, int] = field(default_factory=dict)
    loads_l3: bool = True  # it can load GCache's shared L3 (a vLLM server: only with the connector, --l3)


@dataclass
class Prompt:
    """One request as the policies see it: token count, page ids per page size (lazy), L3 view.

    Workers may tokenize differently (a gcache-worker by bytes, a vLLM server with its model's
    tokenizer): `at(url)` is the prompt as that worker's tokenizer sees it (`views`, by the
    tokenizer key `key_of` gives the worker; this one when it names none)."""

    num_tokens: int
    ids_for: Callable[[int], Sequence[int]]
    l3: Mapping[int, int]
    default_page_size: int
    now: float = 0.0  # the router's clock
    image: bytes | None = None  # the first image's content hash (image affinity), if any
    views: Mapping[str, Prompt] = field(default_factory=dict)  # tokenizer key -> the prompt under it
    key_of: Mapping[str, str] = field(default_factory=dict)  # worker url -> tokenizer key

    def at(self, url: str) -> Prompt:
        return self.views.get(self.key_of.get(url, ""), self)


class Mode(enum.StrEnum):
    """What decided a pick (the picks_<mode> counters, the explain output)."""

    CACHE = "cache"  # the cache match (with load as part of the score)
    LOAD = "load"  # load alone (least_load, or an imbalance guard)
    CAPACITY = "capacity"  # approx_tree: the worker with the most room in its tree
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    FALLBACK = "fallback"  # the router's own: the chosen worker failed, another took it


@dataclass(frozen=True)
class Choice:
    url: str
    mode: Mode  # cache | load | capacity | round_robin | random | fallback
    scores: dict  # url -> what the policy saw (explain)


def image_home_of(p: Prompt, cands: Sequence[Candidate]) -> str | None:
    """The worker a request's first image maps to: rendezvous (highest random weight) hashing of
    the image's content hash over the candidates, so every router agrees and a worker joining
    or leaving moves only the images that map to it."""
    image = p.image
    if image is None or not cands:
        return None
    return max(cands, key=lambda c: (hashlib.blake2b(image + c.url.encode(), digest_size=8).digest(), c.url)).url


def load_of(c: Candidate, cfg: RouterConfig) -> float:
    """Load in request units: published running + waiting (or this router's in-flight if
    higher) plus queued uncached prompt tokens (work not started yet)."""
    if c.reg is None:
        return float(c.inflight)
    ld = c.reg.load
    return max(ld.running + ld.waiting, c.inflight) + ld.queued_tokens / cfg.load_tokens_per_request


def imbalanced(loads: Sequence[float], cfg: RouterConfig) -> bool:
    hi, lo = max(loads), min(loads)
    return hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold


def tier_match(p: Prompt, c: Candidate) -> tuple[TierMatch, int]:
    """(window-safe tier match, page size) of one candidate."""
    p = p.at(c.url)
    if c.reg is None:
        return TierMatch(), p.default_page_size
    ps = c.reg.page_size
    ids = p.ids_for(ps)
    return match_worker(ids, (p.num_tokens - 1) // ps, c.flags, p.l3 if c.loads_l3 else {}, ps, c.reg.window), ps


class Policy(ABC):
    """A routing policy: scores the candidate workers for one prompt.

    The router core (gcache.router.core) calls choose() for every request, with at least one
    candidate, then commit() with the worker the request went to, and forget() when a worker
    leaves the cluster view; /route explain calls choose() without commit(). Calls come under
    the core's lock, one at a time.
    Subclasses set `name` (the RouterPolicy that make_policy builds them for) and implement
    evaluate; choose's default takes the highest score, ties to the higher rendezvous rank.
    """

    name: RouterPolicy

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def evaluate(self, p: Prompt, cands: list[Candidate]) -> tuple[Mode, dict]:
        """(mode, {url: info}) for every candidate, info a dict with at least a float
        "score" (higher wins) plus what the policy saw (shown by /route explain). Read-only:
        changes no state of the policy, so it can explain a pick without making it."""

    def choose(self, p: Prompt, cands: list[Candidate]) -> Choice:
        """The pick for p among cands (non-empty): by default the best evaluate() score,
        ties to the higher rank. Does not commit it."""
        mode, scores = self.evaluate(p, cands)
        best = max(cands, key=lambda c: (scores[c.url]["score"], c.rank))
        return Choice(best.url, mode, scores)

    def commit(self, p: Prompt, url: str) -> None:
        """The request went to url (policies that learn from their own decisions)."""

    def forget(self, url: str) -> None:
        """The worker left: drop what the policy keeps about it."""


class LeastLoad(Policy):
    name = RouterPolicy.LEAST_LOAD

    def evaluate(self, p, cands):
        return Mode.LOAD, {c.url: {"load": load_of(c, self.cfg), "score": -load_of(c, self.cfg)} for c in cands}


class CacheAware(Policy):
    """The seed's score over the window-safe tier match; until a worker publishes what it
    got, the ends of prompts this router sent it count as L1 (recent.py)."""

    name = RouterPolicy.CACHE_AWARE

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__(cfg)
        self.recent = RecentPrompts(cfg.recent_ttl_s, cfg.recent_max)
        self._ps: dict[str, int] = {}

    def credited(self, p: Prompt, c: Candidate) -> tuple[int, int, int, int]:
        """Tokens credited per tier (l1, l2, l3, window-safe) and the raw L1 overlap, with this
        router's recent prompt ends counted as L1 until the worker publishes them."""
        self._ps[c.url] = c.reg.page_size if c.reg is not None else p.default_page_size
        m, ps = tier_match(p, c)
        q = p.at(c.url)
        sent = self.recent.credit(c.url, q.ids_for(ps), (q.num_tokens - 1) // ps, p.now)
        if sent > m.l1:  # our own recent prompt ends beyond what the worker has published
            m = TierMatch(sent, max(sent, m.l2), max(sent, m.l3), m.raw_l1, m.raw_host)
        return m.l1 * ps, (m.l2 - m.l1) * ps, (m.l3 - m.l2) * ps, m.raw_l1 * ps

    def evaluate(self, p, cands):
        cfg = self.cfg
        loads = {c.url: load_of(c, cfg) for c in cands}
        for c in cands:
            self._ps[c.url] = c.reg.page_size if c.reg is not None else p.default_page_size
        if imbalanced(list(loads.values()), cfg):
            return Mode.LOAD, {u: {"load": ld, "score": -ld} for u, ld in loads.items()}
        top = max(max(loads.values()), cfg.load_norm_min) or 1.0
        w1, w2, w3 = cfg.tier_weights
        out = {}
        image_home = image_home_of(p, cands)
        for c in cands:
            l1, l2, l3, raw = self.credited(p, c)
            pct = (w1 * l1 + w2 * l2 + w3 * l3) / max(1, p.at(c.url).num_tokens)
            bonus = cfg.image_weight if c.url == image_home else 0.0
            out[c.url] = {
                Tier.L1: l1,
                Tier.L2: l2,
                Tier.L3: l3,
                "match": l1 + l2 + l3,
                "raw_overlap": raw,
                "load": loads[c.url],
                "image_home": c.url == image_home,
                "score": cfg.match_weight * pct - loads[c.url] / top + bonus,
            }
        return Mode.CACHE, out

    def commit(self, p, url):
        self.recent.record(url, p.at(url).ids_for(self._ps.get(url, p.default_page_size)), p.now)

    def forget(self, url):
        self.recent.forget(url)
        self._ps.pop(url, None)


class CacheTTFT(CacheAware):
    """Lowest estimated time to first token, in prompt-token units (compute per token is the
    same on every worker, so it cancels):

      own    = prompt tokens - (w1 * l1 + w2 * l2 + w3 * l3)   this request's uncached work
               (window-safe match; an L2 / L3 token costs 1 - its tier weight: the copy)
      queue  = min(queued, requests * own)   the worker's queued uncached tokens, but a request
               waits for at most `own` tokens of each one ahead (the worker's scheduler runs the
               shortest remaining prefill first and shares each step's budget in chunks)
             + the same for this router's requests the worker has not published yet
             + running_tokens * requests    (each running request slows every step)
      cost   = own_weight * own + queue      (own_weight > 1 also charges the work this request
                                              adds to everyone else's wait)

    At low load the queues are short and a conversation stays where its history is (leaving
    costs the whole history); it moves only when the home worker's queue is longer than the
    history it would recompute elsewhere, so load balances itself as the rate grows."""

    name = RouterPolicy.CACHE_TTFT

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__(cfg)
        self.sent: dict[str, deque[float]] = {}  # per worker: own-estimates of requests sent, newest last
        self._last: tuple[Prompt, dict] | None = None

    def unpublished(self, c: Candidate) -> list[float]:
        """Own-estimates of this router's requests the worker's published load does not show yet
        (the newest in-flight ones beyond its published running + waiting)."""
        published = c.reg.load.running + c.reg.load.waiting if c.reg is not None else 0
        missing = max(0, c.inflight - published)
        sent = list(self.sent.get(c.url, ()))
        return sent[len(sent) - missing :] if missing else []

    def evaluate(self, p, cands):
        cfg = self.cfg
        w1, w2, w3 = cfg.tier_weights
        out = {}
        for c in cands:
            l1, l2, l3, raw = self.credited(p, c)
            own = max(0.0, p.at(c.url).num_tokens - (w1 * l1 + w2 * l2 + w3 * l3))
            if c.reg is not None:
                published = c.reg.load.running + c.reg.load.waiting
                queued = min(float(c.reg.load.queued_tokens), published * own)
            else:
                published, queued = 0, 0.0
            pending = self.unpublished(c)
            queue = queued + sum(min(e, own) for e in pending) + cfg.ttft_running_tokens * max(published, c.inflight)
            out[c.url] = {
                Tier.L1: l1,
                Tier.L2: l2,
                Tier.L3: l3,
                "match": l1 + l2 + l3,
                "raw_overlap": raw,
                "own_tokens": own,
                "queue_tokens": queue,
                "load": load_of(c, cfg),
                "score": -(cfg.ttft_own_weight * own + queue),
            }
        return Mode.CACHE, out

    def choose(self, p, cands):
        choice = super().choose(p, cands)
        self._last = (p, choice.scores)
        return choice

    def commit(self, p, url):
        super().commit(p, url)
        own = float(p.at(url).num_tokens)
        if self._last is not None and self._last[0] is p and url in self._last[1]:
            own = self._last[1][url].get("own_tokens", own)
        self._last = None
        self.sent.setdefault(url, deque(maxlen=self.cfg.ttft_unpublished_max)).append(own)

    def forget(self, url):
        super().forget(url)
        self.sent.pop(url, None)


class Dynamo(Policy):
    """Lowest overlap_weight * prefill_blocks + decode_blocks (NVIDIA Dynamo's KV router).
    Prefill: the prompt's blocks not in the raw overlap plus the worker's queued prefill;
    decode: the worker's active blocks plus this request's new blocks."""

    name = RouterPolicy.DYNAMO

    def evaluate(self, p, cands):
        cfg, out = self.cfg, {}
        for c in cands:
            m, ps = tier_match(p, c)
            overlap = m.raw_l1 + cfg.dynamo_host_weight * m.raw_host
            new_tokens = max(0.0, p.at(c.url).num_tokens - overlap * ps)
            queued = c.reg.load.queued_tokens if c.reg else 0
            active = max(c.reg.load.active_tokens if c.reg else 0, c.inflight_tokens)
            prefill_blocks = (new_tokens + queued) / ps
            decode_blocks = (active + new_tokens) / ps
            cost = cfg.dynamo_overlap_weight * prefill_blocks + decode_blocks
            out[c.url] = {
                "raw_overlap": m.raw_l1 * ps,
                "host_overlap": m.raw_host * ps,
                "match": int(overlap * ps),
                "prefill_blocks": prefill_blocks,
                "decode_blocks": decode_blocks,
                "load": load_of(c, cfg),
                "score": -cost,
            }
        return Mode.CACHE, out


class ApproxTree(Policy):
    """sgl-router's cache_aware: per worker, the page ids of prompts this router sent (LRU,
    capped); imbalanced (on this router's in-flight counts) -> least load; else the longest
    match if it covers more than cache_threshold of the prompt, else the smallest tree."""

    name = RouterPolicy.APPROX_TREE

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__(cfg)
        self.trees: dict[str, OrderedDict[int, None]] = {}
        self._chosen_ps = cfg.page_size

    def _page_size(self, cands) -> int:
        for c in cands:
            if c.reg is not None:
                return c.reg.page_size
        return self.cfg.page_size

    def evaluate(self, p, cands):
        cfg = self.cfg
        loads = [float(c.inflight) for c in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.approx_balance_abs_threshold and hi > lo * cfg.approx_balance_rel_threshold:
            return Mode.LOAD, {c.url: {"load": float(c.inflight), "score": -float(c.inflight)} for c in cands}
        matched, longest = {}, 1
        for c in cands:
            ids = p.at(c.url).ids_for(self._page_size(cands))
            longest = max(longest, len(ids))
            tree, n = self.trees.get(c.url), 0
            if tree:
                while n < len(ids) and ids[n] in tree:
                    n += 1
            matched[c.url] = n
        best = max(matched.values())
        ps = self._page_size(cands)
        if best / longest > cfg.approx_cache_threshold:
            return Mode.CACHE, {
                c.url: {"match": matched[c.url] * ps, "load": float(c.inflight), "score": matched[c.url]} for c in cands
            }
        return Mode.CAPACITY, {
            c.url: {
                "match": matched[c.url] * ps,
                "tree_pages": len(self.trees.get(c.url, ())),
                "load": float(c.inflight),
                "score": -len(self.trees.get(c.url, ())),
            }
            for c in cands
        }

    def commit(self, p, url):
        tree = self.trees.setdefault(url, OrderedDict())
        ids = p.at(url).ids_for(self._chosen_ps)
        for pid in reversed(ids):  # suffix first: page 0 ends most recent, so LRU cuts leaves first
            tree[pid] = None
            tree.move_to_end(pid)
        while len(tree) > self.cfg.approx_max_pages:
            tree.popitem(last=False)

    def choose(self, p, cands):
        self._chosen_ps = self._page_size(cands)  # commit() hashes at the page size it matched with
        return super().choose(p, cands)

    def forget(self, url):
        self.trees.pop(url, None)


class RoundRobin(Policy):
    name = RouterPolicy.ROUND_ROBIN

    def __init__(self, cfg):
        super().__init__(cfg)
        self.next = 0

    def evaluate(self, p, cands):
        order = sorted(c.url for c in cands)
        target = order[self.next % len(order)]
        return Mode.ROUND_ROBIN, {c.url: {"load": load_of(c, self.cfg), "score": float(c.url == target)} for c in cands}

    def commit(self, p, url):
        self.next += 1


class Random(Policy):
    name = RouterPolicy.RANDOM

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rng = _random.Random(cfg.seed)

    def evaluate(self, p, cands):
        return Mode.RANDOM, {c.url: {"load": load_of(c, self.cfg), "score": 0.0} for c in cands}

    def choose(self, p, cands):
        _, scores = self.evaluate(p, cands)
        url = self.rng.choice(sorted(c.url for c in cands))
        return Choice(url, Mode.RANDOM, scores)


POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (CacheAware, CacheTTFT, Dynamo, ApproxTree, LeastLoad, RoundRobin, Random)
}


def make_policy(cfg: RouterConfig) -> Policy:
    return POLICY_CLASSES[cfg.policy](cfg)
