"""The connector's scheduler half: how long a prefix the store holds, which blocks to load
it into, and which freshly computed pages to save.

A hit is counted from vLLM's own (block-aligned) local hit on: full-attention pages must all
be stored (one batch_exists_prefix over every rank and segment of their values), and each
sliding-window group must hold the window tail before the cut (plan.best_cut). Saves cover
the prompt's pages as the forward computes them (chunk by chunk under chunked prefill);
sliding-window groups save only checkpoint tails (plan.prompt_tail_pages), in the step that
computes them, before vLLM frees out-of-window blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.events.source import L3EventSource, Page
from gcache.integrations.vllm.kv import plan
from gcache.integrations.vllm.kv.keys import MMItem, prompt_page_hashes
from gcache.integrations.vllm.kv.meta import GCacheConnectorMetadata, LoadSpec, PageRef, SaveSpec
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
    from gcache.integrations.vllm.kv.settings import ConnectorSettings
    from gcache.integrations.vllm.kv.stats import ConnectorStats

log = logging.getLogger("gcache.integrations.vllm")
NULL_BLOCK = 0  # vLLM's null block (a sliding-window group's out-of-window slots)
TRACKED_MAX = 65536  # requests tracked at once; beyond that new ones are neither loaded nor saved


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
    # KV events (events/source.py): vLLM's own block hashes and the prompt's tokens (references to
    # the request's lists, not copies); None when its pages are not announced.
    block_hashes: Sequence[bytes] | None = None
    tokens: Sequence[int] = ()


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
    ) -> None:
        self.settings = settings
        self.groups = groups
        self.full = [g for g in groups if g.kind != AttentionKind.SWA]
        self.swa = [g for g in groups if g.kind == AttentionKind.SWA]
        self.block_size = groups[0].block_size
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
            every = 1 if self.settings.swa_every_page else self.settings.checkpoint_pages
            track.swa_pages = {
                g.index: plan.prompt_tail_pages(len(prompt), self.block_size, every, g.tail) for g in self.swa
            }
            if self.events is not None and self._announceable(request, items):
                track.block_hashes, track.tokens = request.block_hashes, prompt
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
            if p < len(hashes)
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

    def _tag(self, group: Group) -> GroupTag:
        if self.tags is None:
            raise RuntimeError("GCacheConnector scheduler: value keys asked for before the workers' handshake")
        return self.tags[group.index]

    def _keys(self, hashes: list[str], group: Group) -> list[bytes]:
        tag = self._tag(group)
        return [k for h in hashes for keys in self.rank_keys for k in keys.value_keys(h, group, tag)]

    def _per_page(self, group: Group) -> int:
        return self._tag(group).segments * len(self.rank_keys)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        track = self._track(request)  # saving needs it too (a kv_producer never loads)
        if track is None or not self.load or track.no_load or self.tags is None:
            return 0, False
        bs = self.block_size
        local = num_computed_tokens // bs
        most = (track.prompt_len - 1) // bs  # vLLM computes at least the prompt's last token
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
        if self.swa and full_end > local:
            asks: list[bytes] = []
            spans: list[tuple[Group, int, int, int]] = []
            for group in self.swa:
                keys = self._keys(track.hashes[local:full_end], group)
                spans.append((group, len(asks), len(keys), self._per_page(group)))
                asks += keys
            flags = self.store.exists_flags(asks)  # one round trip for every group
            for group, at, n, per_page in spans:
                page_flags = flags[at : at + n]
                present = [all(page_flags[i : i + per_page]) for i in range(0, n, per_page)]
                swa.append((group.tail, present))
                wanted = track.swa_pages.get(group.index, set())
                gone += [(group, local + i) for i, there in enumerate(present) if not there and local + i in wanted]
        self._missing(track, gone)
        end = plan.best_cut(local, full_end, swa)
        self.stats.count("lookup_s", time.perf_counter() - start)
        if end <= local:
            track.hit = None
            return 0, False
        track.hit = (local, end)
        tokens = end * bs - num_computed_tokens
        # vLLM reports per-block load errors only for one KV cache group; hybrid models load
        # between steps, where a failure recomputes the request.
        asynchronous = len(self.groups) > 1 or tokens >= self.settings.async_load_min_tokens
        return tokens, asynchronous

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        track = self.tracks.get(request.request_id)
        if track is None or num_external_tokens <= 0 or track.hit is None:
            return
        local, end = track.hit
        track.hit = None
        count = num_external_tokens // self.block_size
        if count != end - local:
            log.warning(
                "GCache connector: vLLM allocated %d external tokens, planned %d", num_external_tokens, end - local
            )
            end = min(end, local + count)
        pages = []
        for group in self.groups:
            row = blocks.blocks[group.index]
            for p in range(local, end):
                block = row[p]
                if not block.is_null:  # a sliding-window group gets only the window tail
                    pages.append(PageRef(group.index, track.hashes[p], block.block_id))
        asynchronous = len(self.groups) > 1 or num_external_tokens >= self.settings.async_load_min_tokens
        self.pending_loads.append(LoadSpec(request.request_id, tuple(pages), asynchronous))
        track.loading = frozenset(p.block_id for p in pages)
        self.stats.count("hit_tokens", num_external_tokens)
        self.stats.count("loads_async" if asynchronous else "loads_sync")

    # -- steps --------------------------------------------------------------------------

    def _plan_saves(self, req_id: str, track: Track, computed_after: int) -> SaveSpec | None:
        done = min(computed_after, track.prompt_len) // self.block_size
        if not self.save or self.tags is None or done <= track.saved_upto:
            return None
        pages = []
        page_nos: list[int] = []
        for group in self.groups:
            row = track.block_ids[group.index] if group.index < len(track.block_ids) else []
            wanted = None if group.kind != AttentionKind.SWA else track.swa_pages[group.index]
            for p in range(track.saved_upto, min(done, len(row))):
                if (wanted is None or p in wanted) and row[p] != NULL_BLOCK:
                    pages.append(PageRef(group.index, track.hashes[p], row[p]))
                    page_nos.append(p)
        track.saved_upto = done
        if not pages:
            return None
        if self.events is not None and track.block_hashes is not None:
            self.events.saved(self._event_pages(track, [(self.groups[r.group], p) for r, p in zip(pages, page_nos)]))
        self.saving.add(req_id)
        return SaveSpec(req_id, tuple(pages))

    def build_meta(self, out: SchedulerOutput) -> GCacheConnectorMetadata:
        saves = []
        for new in out.scheduled_new_reqs:
            track = self.tracks.get(new.req_id)
            if track is None:
                continue
            track.block_ids = [list(ids) for ids in new.block_ids]
            track.saved_upto = new.num_computed_tokens // self.block_size  # hits are stored already
            spec = self._plan_saves(new.req_id, track, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
            if spec:
                saves.append(spec)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            track = self.tracks.get(req_id)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption: new blocks, from its hit on
                track.block_ids = [list(ids) for ids in (new_ids or ())]
                track.saved_upto = cached.num_computed_tokens[i] // self.block_size
            elif new_ids is not None:
                for group, ids in enumerate(new_ids):
                    track.block_ids[group].extend(ids)
            spec = self._plan_saves(req_id, track, cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id])
            if spec:
                saves.append(spec)
        loads, self.pending_loads = self.pending_loads, []
        return GCacheConnectorMetadata(
            loads=loads, saves=saves, preempted=frozenset(getattr(out, "preempted_req_ids", None) or ())
        )

    def worker_output(self, output: KVConnectorOutput) -> None:
        """The worker's report of a step: a request whose load failed is not loaded again (a
        retry would find the same pages and fail the same way)."""
        failed = set(getattr(output, "failed_recving", None) or ())
        bad_blocks = set(getattr(output, "invalid_block_ids", None) or ())
        if not failed and not bad_blocks:
            return
        for req_id, track in self.tracks.items():
            if req_id in failed or (bad_blocks and track.loading & bad_blocks):
                track.no_load = True
                track.loading = frozenset()
                # vLLM recomputes from the first failed page on: save those pages again.
                first = min(
                    (p for row in track.block_ids for p, b in enumerate(row) if b in bad_blocks),
                    default=0 if req_id in failed else track.saved_upto,
                )
                track.saved_upto = min(track.saved_upto, first)

    def finished(self, request: Request) -> bool:
        """True when the request's blocks must wait for its saves (the worker reports them)."""
        self.tracks.pop(request.request_id, None)
        if request.request_id in self.saving:
            self.saving.discard(request.request_id)
            return True
        return False
