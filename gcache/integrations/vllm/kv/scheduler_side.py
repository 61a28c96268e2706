"""The connector's scheduler half: how long a prefix the store holds, which blocks to load
it into, and which freshly computed pages to save.

A hit is counted from vLLM's own (block-aligned) local hit on: full-attention pages must all
be stored (one batch_exists_prefix over every rank and segment of their values), and each
sliding-window group must hold the window tail before the cut (plan.best_cut). A hit stops
before the page holding the prompt's last token, except that a full-attention prompt ending on
a page boundary loads that page too and reports prompt - 1 tokens (plan.loadable_pages). Saves cover
the prompt's pages as the forward computes them (chunk by chunk under chunked prefill);
sliding-window groups save only checkpoint tails (plan.prompt_tail_pages), in the step that
computes them, before vLLM frees out-of-window blocks. State groups (state_groups.py) save
the boundary states vLLM offers, prompt and decode alike (with the attention pages up to the
furthest one), and a hit needs every state group's state at exactly the cut.

A request's prefix is prefetched when it arrives (prefetch.py, where the worker shares this
process): the first ask answers "not yet" until the read returns, then plans a copy from
staging. Each load runs in the step or between steps by its measured cost (load_choice.py).
The async tax is counted: steps spent in WAITING_FOR_REMOTE_KVS, and the step times of other
requests with loads running and without.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.events.source import L3EventSource, Page
from gcache.integrations.vllm.kv import plan
from gcache.integrations.vllm.kv.async_tax import AsyncTax
from gcache.integrations.vllm.kv.keys import MMItem, prompt_page_hashes, salt_hash
from gcache.integrations.vllm.kv.load_choice import LoadCosts, choose_async
from gcache.integrations.vllm.kv.meta import GCacheConnectorMetadata, LoadSpec, PageRef, SaveSpec
from gcache.integrations.vllm.kv.prefetch import Prefetcher
from gcache.integrations.vllm.kv.state_groups import (
    StateOffer,
    admitted,
    boundary_offers,
    extend_hashes,
    why_not_served,
)
from gcache.integrations.vllm.transfer import digests
from gcache.integrations.vllm.transfer.staging import StagingPool
from gcache.serving.announce.wire import KIND_FULL, KIND_SWA

if TYPE_CHECKING:  # vLLM's types: Any to the type check (not installed in .venv)
    from collections.abc import Callable, Sequence

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from gcache.integrations.common.guarded_store import GuardedStore
    from gcache.integrations.vllm.kv.groups import Group
    from gcache.integrations.vllm.kv.keys import GroupTag, PageKeys
    from gcache.integrations.vllm.kv.link import WorkerLink
    from gcache.integrations.vllm.kv.settings import ConnectorSettings
    from gcache.integrations.vllm.kv.stats import ConnectorStats

log = logging.getLogger("gcache.integrations.vllm")
NULL_BLOCK = 0  # vLLM's null block (a sliding-window group's out-of-window slots)
UNPLACED = -1  # a state load's block when vLLM gave none: the worker fails that load
TRACKED_MAX = 65536  # requests tracked at once; beyond that new ones are neither loaded nor saved
IDLE_PREFETCH_WAIT_S = 0.05  # an idle engine's scheduler waits this long per step for a prefetch
# A busy step waits for prefetches and async loads at most gcache_load_step_fraction of a plain
# step, and never longer than this (a step time measured on a stalled machine).
BUSY_WAIT_MAX_S = 0.05


@dataclass
class Track:
    """What the scheduler side remembers of one live request."""

    prompt_len: int
    hashes: list[str]  # page hashes of the prompt's full pages
    block_ids: list[list[int]] = field(default_factory=list)  # per group, block id per page
    saved_upto: int = 0  # pages before this were saved (or came from a hit)
    swa_pages: dict[int, set[int]] = field(default_factory=dict)  # per sliding-window group: pages worth saving
    hit: tuple[int, int] | None = None  # (local pages, end pages) of the last lookup
    loading: frozenset[int] = frozenset()  # the blocks its load in flight fills
    no_load: bool = False  # a load of it failed: vLLM recomputes it, and it is not looked up again
    staged: bool = False  # its hit is in prefetch staging (planned from the prefetch, not a lookup)
    asynchronous: bool = False  # the last hit's load runs between steps
    # KV events (events/source.py): vLLM's own block hashes and the prompt's tokens (references to
    # the request's lists, not copies); None when its pages are not announced.
    block_hashes: Sequence[bytes] | None = None
    tokens: Sequence[int] = ()
    # State groups: the request's tokens so far (vLLM's growing list, not a copy), to extend
    # `hashes` past the prompt for decode-time states; the pages up to the furthest state offered.
    all_tokens: Sequence[int] = ()
    seed: str | None = None  # the chain's seed (cache salt)
    cache_salt: str | None = None
    items: tuple[MMItem, ...] = ()
    state_upto: int = 0
    state_boundaries: int = 0  # boundaries whose states were planned for saving (bounded per request)
    branch: int = 0  # the end of the stored prefix its lookup found, in pages (a prefix seen before)
    loaded_end: int = 0  # the end of its last load, in pages, until its first step plans saves


class SchedulerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        groups: list[Group],
        rank_keys: list[PageKeys],
        store: GuardedStore,
        stats: ConnectorStats,
        *,
        load: bool,
        save: bool,
        events: L3EventSource | None = None,
        hash_of: Callable[[bytes], int | bytes] = bytes,
        find_link: Callable[[], WorkerLink | None] = lambda: None,
        register_buffer: Callable[[int, int], object] = lambda base, size: None,
    ) -> None:
        self.settings = settings
        self.groups = groups
        self.full = [g for g in groups if g.kind == AttentionKind.FULL]
        self.swa = [g for g in groups if g.kind == AttentionKind.SWA]
        self.states = [g for g in groups if g.kind == AttentionKind.STATE]
        why = why_not_served([g.state for g in self.states if g.state is not None])
        if why:
            log.warning("GCacheConnector: %s; nothing is loaded or saved", why)
            load = save = False
        self.block_size = groups[0].block_size
        # Loads may take a prompt's last page (plan.loadable_pages): full-attention groups only. A
        # state at the last cut includes the token vLLM recomputes; a sliding-window group's
        # checkpoint tail for that cut is not shown to serve the recomputed token's window.
        self.last_page = settings.load_last_page and all(g.kind == AttentionKind.FULL for g in groups)
        self.rank_keys = rank_keys
        self.tags: dict[int, GroupTag] | None = None  # group index -> GroupTag, from the workers' handshake
        self.store = store
        self.stats = stats
        self.load = load
        self.save = save
        self.tracks: dict[str, Track] = {}
        self.pending_loads: list[LoadSpec] = []
        self.saving: set[str] = set()  # requests with saves planned: their blocks wait for them
        self.events = events  # the L3 as vLLM KV events (None: off)
        self.hash_of = hash_of  # vLLM's block hash -> what its events carry (maybe_convert_block_hash)
        self.value_bytes: dict[int, int] = {}  # per group: one value's bytes (the workers' handshake)
        self.costs = LoadCosts()
        self.find_link = find_link  # the worker in this process, if any (link.py)
        self.register_buffer = register_buffer  # the client's, for the prefetch staging
        self.prefetcher: Prefetcher | None = None
        self._prefetch_checked = False  # whether prefetch was set up (or found impossible)
        self.tax = AsyncTax(stats, self.costs)
        self.digests = digests.from_env()  # debug only (transfer/digests.py)
        self._waited_s = 0.0  # this step's scheduler waited this long for prefetches

    # -- requests -----------------------------------------------------------------------

    def _cacheable(self, request: Request) -> bool:
        # A LoRA adapter changes the KV of the same token ids and is not in the keys: not cached.
        # Multimodal items are (keys.prompt_page_hashes).
        return request.prompt_token_ids is not None and getattr(request, "lora_request", None) is None

    def _track(self, request: Request) -> Track | None:
        track = self.tracks.get(request.request_id)
        if track is None and self._cacheable(request) and len(self.tracks) < TRACKED_MAX:
            prompt = request.prompt_token_ids
            items = [
                MMItem(f.identifier, f.mm_position.offset, f.mm_position.length)
                for f in getattr(request, "mm_features", None) or ()
            ]
            hashes = prompt_page_hashes(prompt, self.block_size, getattr(request, "cache_salt", None), items)
            track = Track(prompt_len=len(prompt), hashes=hashes)
            if self.states:
                track.all_tokens = getattr(request, "all_token_ids", prompt)
                track.cache_salt = getattr(request, "cache_salt", None)
                track.seed, track.items = salt_hash(track.cache_salt), tuple(items)
            every = 1 if self.settings.swa_every_page else self.settings.checkpoint_pages
            track.swa_pages = {
                g.index: plan.prompt_tail_pages(len(prompt), self.block_size, every, g.tail) for g in self.swa
            }
            # A state model's states are announced too (their group's kind, "mamba"): a router
            # credits its pages only up to a boundary whose state is announced (the window rule
            # with a window of one token). Its tokens are the growing list: decode-time states.
            if self.events is not None and self._announceable(request, items):
                track.block_hashes = request.block_hashes
                track.tokens = track.all_tokens if self.states else prompt
            self.tracks[request.request_id] = track
        return track

    def _announceable(self, request: Request, items: list[MMItem]) -> bool:
        """Its pages can be announced as vLLM names them: one vLLM block hash per page (vLLM
        may hash at a finer block size), and no extra keys (images, a cache salt), which a
        consumer could not match from the event's tokens alone (docs/kv-events.md)."""
        hashes = getattr(request, "block_hashes", None)
        n = getattr(request, "num_tokens", len(request.prompt_token_ids or ()))
        if items or getattr(request, "cache_salt", None) or not isinstance(hashes, list):
            return False
        return len(hashes) == n // self.block_size

    def _event_pages(self, track: Track, refs: list[tuple[Group, int]]) -> list[Page]:
        hashes, bs = track.block_hashes, self.block_size
        if hashes is None:
            return []
        return [
            Page(
                group.index,
                group.spec_kind or (KIND_SWA if group.kind == AttentionKind.SWA else KIND_FULL),
                group.window,
                bs,
                self.hash_of(hashes[p]),
                self.hash_of(hashes[p - 1]) if p else None,
                track.tokens[p * bs : (p + 1) * bs],
                self._keys([track.hashes[p]], group),
            )
            for group, p in refs
            if p < len(hashes) and (p + 1) * bs <= len(track.tokens)
        ]

    def _missing(self, track: Track, refs: list[tuple[Group, int]]) -> None:
        """Pages a lookup found absent (the store answered): withdrawn if they were announced."""
        if self.events is None or track.block_hashes is None or not refs or self.store.down:
            return
        hashes = track.block_hashes
        self.events.missing(
            [
                Page(group.index, "", None, self.block_size, self.hash_of(hashes[p]), None, (), ())
                for group, p in refs
                if p < len(hashes)
            ]
        )

    # -- lookups ------------------------------------------------------------------------

    def set_tags(self, per_rank: dict[int, dict[int, GroupTag]]) -> None:
        """The workers' handshake: every rank must name its values alike, or nothing is cached."""
        tags = list(per_rank.values())
        if not tags or any(t != tags[0] for t in tags):
            log.error("GCacheConnector: the workers' KV layouts differ (%s); nothing is loaded or saved", per_rank)
            self.tags = None
            return
        self.tags = dict(tags[0])
        log.info("GCacheConnector scheduler: value tags %s", self.tags)
        self._prefetch()  # its staging is allocated (and faulted in) now, not by the first request

    def _tag(self, group: Group) -> GroupTag:
        if self.tags is None:
            raise RuntimeError("GCacheConnector scheduler: value keys asked for before the workers' handshake")
        return self.tags[group.index]

    def _keys(self, hashes: list[str], group: Group) -> list[bytes]:
        tag = self._tag(group)
        return [k for h in hashes for keys in self.rank_keys for k in keys.value_keys(h, group, tag)]

    def _per_page(self, group: Group) -> int:
        return self._tag(group).segments * len(self.rank_keys)

    # -- prefetch ---------------------------------------------------------------------

    def _prefetch(self) -> Prefetcher | None:
        """The prefetcher, set up on first use: only with the worker in this process (its
        staging memory), tensor parallel size 1, and full-attention groups only."""
        if self._prefetch_checked or self.tags is None:
            return self.prefetcher
        self._prefetch_checked = True
        linked = self.find_link() if self.settings.prefetch and self.load else None
        why = None
        if linked is None:
            why = "off, or the worker is in another process"
        elif linked.direct:  # a load in the step costs about what a prefetch's read alone does
            why = "off: loads go straight from the store's shared memory into the KV blocks"
        elif self.swa or any(g.kind != AttentionKind.FULL for g in self.groups) or len(self.rank_keys) != 1:
            why = "only for full-attention models at tensor parallel size 1"
        else:
            slot = max(linked.value_bytes.values())
            nbytes = self.settings.prefetch_mib << 20
            if nbytes < slot:
                why = f"gcache_prefetch_mib holds no {slot}-byte value"
            else:
                pool = StagingPool(linked.alloc_host(nbytes), slot)
                self.register_buffer(pool.base, pool.nbytes)
                self.prefetcher = Prefetcher(
                    pool, self.store, self.stats, linked.segment_spans, self.settings.prefetch_requests_max
                )
                linked.staging, linked.give_back = pool, self.prefetcher.give_back
        log.info("GCacheConnector scheduler: prefetch %s", why or f"on, {self.settings.prefetch_mib} MiB staging")
        return self.prefetcher

    def arrived(self, request: Request, local_pages: int) -> None:
        """vLLM's on_new_request: starts reading the prefix past the pages vLLM holds itself."""
        track = self._track(request)
        prefetcher = self._prefetch() if track is not None and not track.no_load else None
        if prefetcher is None or track is None:
            return
        most = self._loadable(track)
        # vLLM's own hit never covers the prompt's last token, whatever it holds.
        local_pages = min(local_pages, plan.loadable_pages(track.prompt_len, self.block_size, last_page=False))
        if most <= local_pages:
            return
        groups = [g.index for g in self.groups]
        keys = [[self._keys([track.hashes[p]], g) for g in self.groups] for p in range(local_pages, most)]
        prefetcher.start(request.request_id, local_pages, groups, keys)

    def _loadable(self, track: Track) -> int:
        """The prompt pages a hit of this request may cover (plan.loadable_pages)."""
        return plan.loadable_pages(track.prompt_len, self.block_size, self.last_page)

    def _from_prefetch(self, req_id: str, track: Track, local: int, most: int) -> tuple[int | None, bool] | None:
        """The hit from the request's prefetch: None when it has none (ask the store), (None,
        False) while it reads (vLLM asks again next step), else (pages end, False)."""
        prefetcher = self.prefetcher
        entry = prefetcher.get(req_id) if prefetcher is not None else None
        if prefetcher is None or entry is None:
            return None
        if local < entry.first:
            # vLLM evicted pages it held when the request arrived: the prefetch never read them
            # (nor asked whether the store has them). A load of them would be planned unlooked-up
            # and fail where the store evicted them too; the lookup asks for every page instead.
            prefetcher.drop(req_id)
            self.stats.count("prefetch_behind")
            return None
        if not entry.done.is_set():
            left = self.settings.prefetch_wait_s - (time.monotonic() - entry.started)
            budget = min(left, self._wait_budget(req_id) - self._waited_s)
            if budget > 0:  # bounded per step: see _wait_budget
                started = time.monotonic()
                entry.done.wait(budget)
                self._waited_s += time.monotonic() - started
            if not entry.done.is_set():
                if left > 0:
                    return None, False
                prefetcher.cancel(req_id)  # the store is slow: recomputed, never looked up again now
                self.stats.count("prefetch_timeouts")
                return 0, False
        if entry.staged_end < most:  # the first page it could not read (KV events withdraw it)
            self._missing(track, [(g, entry.staged_end) for g in self.full])
        end = min(entry.staged_end, most)
        if end <= local:
            prefetcher.drop(req_id)  # nothing staged past vLLM's own pages: a miss
            return 0, False
        track.staged = True
        return end, False

    def _wait_budget(self, req_id: str) -> float:
        """How long this step's scheduler may wait for a prefetch in all. Idle: nobody else
        waits on the step. Busy: as long as a load in the step may add (the load choice's
        fraction of a plain step), since not waiting costs the request a whole step."""
        if not self.tax.others_running(req_id):
            return IDLE_PREFETCH_WAIT_S
        return self.busy_wait_s()

    def busy_wait_s(self) -> float:
        """What a busy step may add to wait for a transfer that is about to land."""
        return min(BUSY_WAIT_MAX_S, self.settings.load_step_fraction * self.costs.recent_step_s())

    # -- lookups ------------------------------------------------------------------------

    def loads_asynchronously(self, req_id: str, tokens: int, pages: int, staged: bool) -> bool:
        """Whether a hit of `pages` pages loads between steps (load_choice.py). State groups
        must: a state loaded in start_load_kv lands after vLLM copied the not-yet-loaded boundary
        slot into the running slot (wrong outputs)."""
        if self.states or len(self.groups) > 1:
            # vLLM reports per-block load errors only for one KV cache group; hybrid models load
            # between steps, where a failure recomputes the request.
            return True
        if self.settings.async_load_min_tokens is not None:  # the fixed rule, when set
            return tokens >= self.settings.async_load_min_tokens
        nbytes = pages * len(self.rank_keys) * sum(self.value_bytes.get(g.index, 0) for g in self.groups)
        return choose_async(
            self.costs.load_seconds(nbytes, staged),
            self.costs.recent_step_s(),
            self.tax.others_running(req_id),
            self.settings.load_step_fraction,
            self.settings.sync_load_max_s,
        )

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        track = self._track(request)  # saving needs it too (a kv_producer never loads)
        if track is None or not self.load or track.no_load or self.tags is None:
            return 0, False
        bs = self.block_size
        local = num_computed_tokens // bs
        most = self._loadable(track)
        track.staged = False
        staged = self._from_prefetch(request.request_id, track, local, most)
        if staged is not None:
            end, _ = staged
            if end is None or end <= local:
                track.hit = None
                return (None, False) if end is None else (0, False)
            track.hit = (local, end)
            tokens = plan.hit_tokens(track.prompt_len, end, bs, num_computed_tokens)
            track.asynchronous = self.loads_asynchronously(request.request_id, tokens, end - local, staged=True)
            return tokens, track.asynchronous
        if most <= local:
            return 0, False
        start = time.perf_counter()
        self.stats.count("lookups")
        full_end = most
        gone: list[tuple[Group, int]] = []  # the first page each group lacks (KV events)
        for group in self.full:  # every layer and rank of each page: the prefix they all hold
            per_page = self._per_page(group)
            found = self.store.exists_prefix(self._keys(track.hashes[local:full_end], group))
            if local + found // per_page < full_end:
                gone.append((group, local + found // per_page))
            full_end = local + found // per_page
        swa: list[tuple[int, list[bool]]] = []
        states: list[list[bool]] = []
        if (self.swa or self.states) and full_end > local:
            asks: list[bytes] = []
            spans: list[tuple[Group, int, int, int]] = []
            for group in self.swa + self.states:  # a state "page" p: the state at cut p + 1
                keys = self._keys(track.hashes[local:full_end], group)
                spans.append((group, len(asks), len(keys), self._per_page(group)))
                asks += keys
            flags = self.store.exists_flags(asks)  # one round trip for every group
            for group, at, n, per_page in spans:
                page_flags = flags[at : at + n]
                present = [all(page_flags[i : i + per_page]) for i in range(0, n, per_page)]
                if group.kind == AttentionKind.STATE:
                    states.append(present)
                    continue
                swa.append((group.tail, present))
                wanted = track.swa_pages.get(group.index, set())
                gone += [(group, local + i) for i, there in enumerate(present) if not there and local + i in wanted]
        elif self.states:
            states = [[] for _ in self.states]  # nothing to serve past vLLM's own hit
        self._missing(track, gone)
        track.branch = full_end
        end = plan.best_cut(local, full_end, swa, states)
        self.stats.count("lookup_s", time.perf_counter() - start)
        if end <= local:
            track.hit = None
            return 0, False
        track.hit = (local, end)
        tokens = plan.hit_tokens(track.prompt_len, end, bs, num_computed_tokens)
        track.asynchronous = self.loads_asynchronously(request.request_id, tokens, end - local, staged=False)
        return tokens, track.asynchronous

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        track = self.tracks.get(request.request_id)
        if track is None or num_external_tokens <= 0 or track.hit is None:
            if track is not None:
                track.loaded_end = 0
            if self.prefetcher is not None:  # no load: its staging goes back
                self.prefetcher.drop(request.request_id)
            return
        local, end = track.hit
        track.hit = None
        count = plan.loaded_pages(num_external_tokens, self.block_size)
        if count != end - local:
            log.warning(
                "GCache connector: vLLM allocated %d external tokens (%d pages), planned %d pages",
                num_external_tokens,
                count,
                end - local,
            )
            end = min(end, local + count)
        track.loaded_end = end
        pages = []
        at: list[tuple[int, int]] = []  # (page, group) of each PageRef
        for group in self.groups:
            row = blocks.blocks[group.index]
            if group.kind == AttentionKind.STATE:  # the state at the cut, into its boundary slot
                last = row[end - 1] if end - 1 < len(row) else None
                block_id = UNPLACED if last is None or last.is_null else last.block_id
                pages.append(PageRef(group.index, track.hashes[end - 1], block_id))
                continue
            for p in range(local, end):
                block = row[p]
                if not block.is_null:  # a sliding-window group gets only the window tail
                    pages.append(PageRef(group.index, track.hashes[p], block.block_id))
                    at.append((p, group.index))
        slots: tuple[int, ...] = ()
        if track.staged and self.prefetcher is not None:
            handed = self.prefetcher.take(request.request_id, local, end)
            if all(a in handed for a in at):
                slots = tuple(handed[a] for a in at)
                self.stats.count("loads_staged")
            elif handed:  # cannot happen (the hit is the staged prefix): loaded from the store
                self.prefetcher.give_back(list(handed.values()))
        asynchronous = track.asynchronous
        if self.digests is not None:  # debug (transfer/digests.py): the blocks a load fills
            shared = [(b.block_id, b.ref_cnt, b.block_hash is not None) for b in blocks.blocks[0][local:end]]
            self.digests.note(
                f"load {request.request_id} local={local} end={end} ext={num_external_tokens} "
                f"computed={request.num_computed_tokens} prompt={track.prompt_len} staged={bool(slots)} "
                f"async={asynchronous} first={[b.block_id for b in blocks.blocks[0][:local]]} "
                f"blocks={shared} keys={[p.page_hash[:12] for p in pages]}"
            )
        self.pending_loads.append(LoadSpec(request.request_id, tuple(pages), asynchronous, slots))
        track.loading = frozenset(p.block_id for p in pages)
        if asynchronous:
            self.tax.park(request.request_id, time.perf_counter())
        self.stats.count("hit_tokens", num_external_tokens)
        self.stats.count("loads_async" if asynchronous else "loads_sync")

    # -- steps --------------------------------------------------------------------------

    def _plan_saves(
        self, req_id: str, track: Track, computed_after: int, states: Sequence[PageRef] = ()
    ) -> SaveSpec | None:
        # Attention pages: the prompt's, and past it up to the furthest boundary state offered.
        limit = max(track.prompt_len, track.state_upto * self.block_size)
        done = min(computed_after, limit) // self.block_size
        if not self.save or self.tags is None or (done <= track.saved_upto and not states):
            return None
        pages = list(states)
        page_nos: list[int] = []
        for group in self.full + self.swa:  # never a state group's positional table
            row = track.block_ids[group.index] if group.index < len(track.block_ids) else []
            wanted = None if group.kind != AttentionKind.SWA else track.swa_pages[group.index]
            for p in range(track.saved_upto, min(done, len(row))):
                if (wanted is None or p in wanted) and row[p] != NULL_BLOCK:
                    pages.append(PageRef(group.index, track.hashes[p], row[p], (p + 1) * self.block_size))
                    page_nos.append(p)
        track.saved_upto = max(track.saved_upto, done)
        if not pages:
            return None
        if self.events is not None and track.block_hashes is not None and (page_nos or states):
            attention = pages[len(states) :]
            refs = [(self.groups[r.group], p) for r, p in zip(attention, page_nos)]
            refs += [(self.groups[r.group], r.tokens // self.block_size - 1) for r in states]  # at their boundary
            self.events.saved(self._event_pages(track, refs))
        self.saving.add(req_id)
        return SaveSpec(req_id, tuple(pages))

    def _state_saves(self, track: Track, offers: list[StateOffer]) -> list[PageRef]:
        """The boundary states vLLM offers this step, as pages to save (their hashes extended
        past the prompt for decode-time states)."""
        if not self.save or self.tags is None:
            return []
        offers = admitted(offers, self.settings.state_admission, track.prompt_len, self.block_size, track.branch)
        if not offers:
            return []
        room = self.settings.state_boundaries_max - track.state_boundaries
        boundaries = sorted({o.page for o in offers})
        if len(boundaries) > room:  # the per-request bound: the earliest boundaries are kept
            kept = set(boundaries[: max(0, room)])
            self.stats.count("state_values_over_bound", sum(o.page not in kept for o in offers))
            offers = [o for o in offers if o.page in kept]
            if not offers:
                return []
        furthest = max(o.page for o in offers) + 1
        rehash = None
        if track.items:
            salt, items = track.cache_salt, track.items
            rehash = lambda tokens: prompt_page_hashes(tokens, self.block_size, salt, items)  # noqa: E731
        if not extend_hashes(track.hashes, track.all_tokens, furthest, self.block_size, track.seed, rehash):
            return []
        track.state_upto = max(track.state_upto, furthest)
        track.state_boundaries += len({o.page for o in offers})
        self.stats.count("state_values_offered", len(offers))
        return [PageRef(o.group, track.hashes[o.page], o.block_id, (o.page + 1) * self.block_size) for o in offers]

    def _saved_from(self, track: Track, num_computed_tokens: int) -> int:
        """Where a request's saves start in its first step: past the pages it holds, including a
        prompt's last page that its load took whole (vLLM counts one token of it uncomputed)."""
        pages = num_computed_tokens // self.block_size
        if track.loaded_end * self.block_size == track.prompt_len and num_computed_tokens == track.prompt_len - 1:
            pages = track.loaded_end
        track.loaded_end = 0
        return pages

    def build_meta(self, out: SchedulerOutput) -> GCacheConnectorMetadata:
        now = time.perf_counter()
        cached = out.scheduled_cached_reqs
        running = {new.req_id for new in out.scheduled_new_reqs} | set(cached.req_ids)
        self.tax.step(running, {spec.req_id for spec in self.pending_loads}, now)
        self._waited_s = 0.0
        saves = []
        offers = boundary_offers(out, {g.index for g in self.states}, self.block_size) if self.states else {}
        for new in out.scheduled_new_reqs:
            track = self.tracks.get(new.req_id)
            if track is None:
                continue
            self.tax.scheduled(new.req_id, now)
            track.block_ids = [list(ids) for ids in new.block_ids]
            track.saved_upto = self._saved_from(track, new.num_computed_tokens)  # hits are stored already
            states = self._state_saves(track, offers.pop(new.req_id)) if new.req_id in offers else []
            computed = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            spec = self._plan_saves(new.req_id, track, computed, states)
            if spec:
                saves.append(spec)
        for i, req_id in enumerate(cached.req_ids):
            track = self.tracks.get(req_id)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            self.tax.scheduled(req_id, now)
            if req_id in cached.resumed_req_ids:  # after a preemption: new blocks, from its hit on
                track.block_ids = [list(ids) for ids in (new_ids or ())]
                track.saved_upto = self._saved_from(track, cached.num_computed_tokens[i])
            elif new_ids is not None:
                for group, ids in enumerate(new_ids):
                    track.block_ids[group].extend(ids)
            states = self._state_saves(track, offers.pop(req_id)) if req_id in offers else []
            computed = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            spec = self._plan_saves(req_id, track, computed, states)
            if spec:
                saves.append(spec)
        for req_id, left in offers.items():  # offered for a request not scheduled this step
            track = self.tracks.get(req_id)
            states = self._state_saves(track, left) if track is not None else []
            spec = self._plan_saves(req_id, track, 0, states) if track is not None and states else None
            if spec:
                saves.append(spec)
        loads, self.pending_loads = self.pending_loads, []
        preempted = frozenset(getattr(out, "preempted_req_ids", None) or ())
        if preempted:
            self.stats.count("requests_preempted", len(preempted))
        return GCacheConnectorMetadata(
            loads=loads,
            saves=saves,
            preempted=preempted,
            idle=not any(out.num_scheduled_tokens.values()),
            load_wait_s=self.busy_wait_s() if self.tax.parked else 0.0,
        )

    def worker_output(self, output: KVConnectorOutput) -> None:
        """The worker's report of a step: a request whose load failed is not loaded again (a
        retry would find the same pages and fail the same way)."""
        self._observe_loads(getattr(output, "kv_connector_stats", None))
        failed = set(getattr(output, "failed_recving", None) or ())
        bad_blocks = set(getattr(output, "invalid_block_ids", None) or ())
        if not failed and not bad_blocks:
            return
        for req_id, track in self.tracks.items():
            if req_id in failed or (bad_blocks and track.loading & bad_blocks):
                track.no_load = True
                track.loading = frozenset()
                track.loaded_end = 0
                # vLLM recomputes from the first failed page on: save those pages again.
                first = min(
                    (p for row in track.block_ids for p, b in enumerate(row) if b in bad_blocks),
                    default=0 if req_id in failed else track.saved_upto,
                )
                track.saved_upto = min(track.saved_upto, first)

    def _observe_loads(self, worker_stats: object) -> None:
        """The workers' load times this step (their connector stats): the load choice's rates."""
        data = getattr(worker_stats, "data", None)
        if isinstance(data, dict):
            self.costs.observe_load(data.get("bytes_loaded", 0), data.get("load_s", 0), staged=False)
            self.costs.observe_load(data.get("staged_bytes_loaded", 0), data.get("staged_load_s", 0), staged=True)

    def gauges(self) -> dict[str, float]:
        """What is held now (not counters): prefetches in flight, staging slots free of all."""
        p = self.prefetcher
        if p is None:
            return {}
        return {
            "prefetch_in_flight": p.in_flight(),
            "prefetch_slots_free": p.pool.free_slots(),
            "prefetch_slots": p.pool.slot_count,
        }

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close(5.0)

    def finished(self, request: Request) -> bool:
        """True when the request's blocks must wait for its saves (the worker reports them)."""
        self.tracks.pop(request.request_id, None)
        self.tax.finished(request.request_id)
        if self.prefetcher is not None:
            self.prefetcher.cancel(request.request_id)
        if request.request_id in self.saving:
            self.saving.discard(request.request_id)
            return True
        return False
