"""The connector's worker half: vLLM's KV views registered once, each KV cache group's pages
moved as one value per (page, group, rank) through staging memory (transfers.Transfers).

Registration reads where every layer's pages lie (page_runs: any of vLLM's six layouts, kernel
blocks, layers sharing a view), picks the mover for the tensors' device (HostMover for CPU KV,
CudaMover for a GPU), allocates the staging pools once and registers them with the client,
and computes each group's key tag, which the scheduler receives through vLLM's handshake.
It also publishes a link.WorkerLink for a scheduler in the same process (its prefetch staging).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv import link
from gcache.integrations.vllm.kv.keys import GroupTag, PageKeys, mla_writer, value_tag
from gcache.integrations.vllm.kv.state_groups import state_tag
from gcache.integrations.vllm.transfer.page_runs import PageRunsError, page_runs
from gcache.integrations.vllm.transfer.staging import StagingPool
from gcache.integrations.vllm.transfer.transfers import Page, Staged, Transfers
from gcache.integrations.vllm.transfer.values import GroupValues
from gcache.wire.worth import ValueKind, Worth

if TYPE_CHECKING:  # torch's type: Any to the type check (not installed in .venv)
    import torch

    import gcache
    from gcache.integrations.common.guarded_store import GuardedStore
    from gcache.integrations.vllm.kv.groups import Group
    from gcache.integrations.vllm.kv.meta import GCacheConnectorMetadata, LoadSpec, PageRef
    from gcache.integrations.vllm.kv.settings import ConnectorSettings
    from gcache.integrations.vllm.kv.stats import ConnectorStats
    from gcache.integrations.vllm.transfer.movers.base import BlockMover

log = logging.getLogger("gcache.integrations.vllm")
CLOSE_TIMEOUT_S = 30.0
STAGING_POOLS = 2  # the staging memory is halved: saves never wait for loads' slots, nor loads for saves'


class LayoutError(ValueError):
    """KV tensors the connector cannot address or move (the message says what it found)."""


def mover_for(device: torch.device) -> BlockMover:
    """The mover for KV on `device` (a torch.device): host memcpys on CPU, DMA on a GPU."""
    device_type = device.type
    if device_type == "cpu":
        from gcache.integrations.vllm.transfer.movers.host import HostMover

        return HostMover()
    if device_type == "cuda":
        try:
            from gcache.integrations.vllm.transfer.movers.cuda import CudaMover
        except ImportError as exc:
            raise LayoutError(f"KV on a GPU needs the CUDA mover, which cannot load here: {exc}") from exc
        try:
            return CudaMover(device=device)
        except Exception as exc:  # no usable CUDA runtime in this process: say so at start
            raise LayoutError(f"KV on {device}: {exc}") from exc
    raise LayoutError(f"GCacheConnector moves KV on CPU and CUDA devices, got {device_type}")


def group_values(
    group: Group, views: list[torch.Tensor], num_blocks: int, segment_bytes_max: int
) -> tuple[GroupValues, GroupTag]:
    """One group's values and their key tag, from its layers' [blocks, heads, tokens, content] views."""
    try:
        runs = [page_runs(v, num_blocks) for v in views]
    except PageRunsError as exc:
        raise LayoutError(f"KV cache group {group.index}: {exc}") from exc
    values = GroupValues(runs, segment_bytes_max)
    first, view = runs[0], views[0]
    if any(r.order != first.order or r.kernel_block_size != first.kernel_block_size for r in runs):
        raise LayoutError(f"KV cache group {group.index}: its layers lie in different layouts")
    layers = [
        (group.layer_ids[i], [(int(o), int(n)) for o, n in zip(runs[i].offsets, runs[i].lengths)]) for i in values.kept
    ]
    if group.state is not None:  # raw state bytes: the tag names what they depend on
        return values, GroupTag(state_tag(group.state, values, layers), values.segments)
    tag = value_tag(
        first.order,
        first.kernel_block_size,
        int(view.shape[1]),
        int(view.shape[3]) * int(view.element_size()),
        str(view.dtype).replace("torch.", ""),
        layers,
        values.segments,
    )
    return values, GroupTag(tag, values.segments)


class WorkerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        groups: list[Group],
        keys: PageKeys,
        client: gcache.Client,
        store: GuardedStore,
        stats: ConnectorStats,
        num_blocks: int,
        engine_id: str = "",
        steps_scheduled_ahead: int = 0,
    ) -> None:
        self.settings = settings
        # Steps vLLM schedules before it has read a step's output (1 with async scheduling): a
        # failed load's blocks may be computed over that many steps more before vLLM recomputes.
        self.steps_scheduled_ahead = steps_scheduled_ahead
        self.unsafe_steps = 0  # steps whose computed pages must not be saved (a load failed)
        self.engine_id = engine_id
        self.link: link.WorkerLink | None = None
        self.groups = groups
        self.keys = keys  # this rank's PageKeys
        self.client = client
        self.store = store
        self.stats = stats
        self.num_blocks = num_blocks
        self.tags: dict[int, GroupTag] = {}
        self.value_bytes: dict[int, int] = {}  # per group: one value's bytes (the handshake's too)
        self.transfers: Transfers | None = None
        self.saving: set[str] = set()  # requests whose saves the scheduler waits for
        self.finished_saving: set[str] = set()  # ...that vLLM says finished: report once copied
        self.load_errors: set[int] = set()
        self.async_done: set[str] = set()
        self.async_failed: set[str] = set()
        self.has_state = any(g.kind == AttentionKind.STATE for g in groups)

    # -- registration -------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        per_group: dict[int, tuple[GroupValues, GroupTag]] = {}
        devices: set[Any] = set()  # torch.device
        for group in self.groups:
            views = []
            for name in group.layer_names:
                view = kv_caches.get(name)
                if view is None:
                    raise LayoutError(f"vLLM registered no KV tensor for layer {name}")
                if len(view.shape) != 4:
                    raise LayoutError(
                        f"layer {name}: a KV view of shape {tuple(view.shape)}, not [blocks, heads, tokens, content]"
                    )
                views.append(view)
                devices.add(view.device)
            per_group[group.index] = group_values(group, views, self.num_blocks, self.settings.value_bytes_max)
        if len(devices) != 1:
            raise LayoutError(f"KV tensors on several devices {sorted(map(str, devices))}")
        mover = mover_for(devices.pop())  # one device per worker
        values = {g: v for g, (v, _) in per_group.items()}
        self.tags = {g: t for g, (_, t) in per_group.items()}
        slot_bytes = max(v.value_bytes for v in values.values())
        pool_bytes = self.settings.staging_bytes // STAGING_POOLS
        if pool_bytes < slot_bytes:
            raise LayoutError(
                f"one page of a KV cache group is {slot_bytes} bytes; gcache_staging_mib "
                f"({self.settings.staging_bytes >> 20}) must hold {STAGING_POOLS} of them"
            )
        pools = [StagingPool(mover.alloc_host(pool_bytes), slot_bytes) for _ in range(STAGING_POOLS)]
        for pool in pools:
            self.client.register_buffer(pool.base, pool.nbytes)
        swa = {g.index for g in self.groups if g.kind == AttentionKind.SWA}
        self.transfers = Transfers(mover, values, swa, pools[0], pools[1], self.store, self.stats, self.settings)
        self.value_bytes = {g: v.value_bytes for g, v in values.items()}
        self.link = link.WorkerLink(
            mover.alloc_host,
            dict(self.value_bytes),
            {g: v.segment_spans() for g, v in values.items()},
            direct=self.transfers.direct,
        )
        link.publish(self.engine_id, self.link)
        log.info(
            "GCacheConnector worker: %s mover%s, values %s, staging %d MiB",
            mover.describe(),
            ", loads straight from the store's shared memory" if self.transfers.direct else "",
            {g: f"{t.tag} ({values[g].value_bytes} B)" for g, t in self.tags.items()},
            self.settings.staging_bytes >> 20,
        )

    def handshake(self) -> dict[int, GroupTag]:
        return dict(self.tags)

    def _transfers(self) -> Transfers:
        if self.transfers is None:
            raise RuntimeError("GCacheConnector worker: a step before vLLM registered its KV caches")
        return self.transfers

    def _pages(self, refs: Iterable[PageRef], keys: bool = True) -> list[Page]:
        """The pages of `refs`; without their store keys when `keys` is False (a staged load
        only copies: no per-page key built on the step's path)."""
        if not keys:
            return [Page(ref.group, [], ref.block_id) for ref in refs]
        out = []
        for ref in refs:
            group = self.groups[ref.group]
            value_keys = self.keys.value_keys(ref.page_hash, group, self.tags[ref.group])
            worth = value_worth(group, ref.tokens) if self.settings.put_worth else None
            out.append(Page(ref.group, value_keys, ref.block_id, worth))
        return out

    def _writes(self, ref: PageRef) -> bool:
        builder = self.keys.builder
        return not builder.is_mla or mla_writer(ref.page_hash, builder.tp_size) == builder.tp_rank

    # -- steps --------------------------------------------------------------------------

    def start_load(self, meta: GCacheConnectorMetadata) -> None:
        for spec in meta.loads:
            try:
                pages = self._pages(spec.pages, keys=not spec.staged)
            except Exception as exc:  # a bad key: fail these pages, vLLM recomputes
                log.error("GCache connector: load of %s refused: %s", spec.req_id, exc)
                self._failed(spec.req_id, spec.asynchronous, {r.block_id for r in spec.pages})
                continue
            if any(r.block_id < 0 for r in spec.pages):  # a state vLLM gave no slot for: recompute
                log.error("GCache connector: load of %s has a state without a block; not loaded", spec.req_id)
                self._failed(spec.req_id, spec.asynchronous, {r.block_id for r in spec.pages if r.block_id >= 0})
                continue
            if spec.staged:
                self._load_staged(spec, pages)
            elif spec.asynchronous:
                self._transfers().load_later(spec.req_id, pages)
            else:
                try:
                    failed = self._transfers().load_now(pages)
                except Exception:  # the store or our bug: these blocks are recomputed
                    log.exception("GCache connector: a load failed")
                    failed = {p.block_id for p in pages}
                self.load_errors |= failed

    def _load_staged(self, spec: LoadSpec, pages: list[Page]) -> None:
        """Values the scheduler's prefetch staged in this process: a copy into the blocks."""
        linked = self.link
        if linked is None or linked.staging is None or linked.give_back is None:  # cannot happen: the scheduler saw it
            log.error("GCache connector: a staged load of %s without the prefetch staging", spec.req_id)
            self._failed(spec.req_id, spec.asynchronous, {r.block_id for r in spec.pages})
            return
        slots, give_back = list(spec.staged), linked.give_back
        staged = Staged(linked.staging.addresses(slots), lambda: give_back(slots))
        if spec.asynchronous:
            self._transfers().load_later(spec.req_id, pages, staged)
            return
        try:
            self._transfers().load_staged_now(pages, staged)
        except Exception:  # our bug: these blocks are recomputed
            log.exception("GCache connector: a staged load failed")
            self.load_errors |= {p.block_id for p in pages}

    def _failed(self, req_id: str, asynchronous: bool, blocks: set[int]) -> None:
        if asynchronous:
            self.async_done.add(req_id)
            if len(self.groups) > 1 or self.has_state:  # block errors of one group only: recompute the request
                self.async_failed.add(req_id)
            else:
                self.load_errors |= blocks
        else:
            self.load_errors |= blocks

    def save_step(self, meta: GCacheConnectorMetadata) -> None:
        """After the step's forward was queued (wait_for_save): this step's pages to the store."""
        pages: list[Page] = []
        req_ids: list[str] = []
        reused = False
        states = 0
        if self.load_errors:
            # A synchronous load of this step failed: vLLM ran this step's forward over the failed
            # blocks (the loading request's and any request that hit them in its prefix cache), and
            # recomputes those requests from the first failed block only once it reads the step's
            # output. The pages computed until then may hold KV built on garbage; saved, they would
            # be kept ("already there") over the right bytes and served to every engine (issue 37).
            # None is saved: a miss; the scheduler saves the loading request's pages again once
            # they are recomputed.
            self.unsafe_steps = 1 + self.steps_scheduled_ahead
        if self.unsafe_steps:
            self.unsafe_steps -= 1
            for spec in meta.saves:
                self.saving.add(spec.req_id)  # reported sent at once: nothing copies from its blocks
            self.stats.count("save_pages_dropped_load_failed", sum(len(spec.pages) for spec in meta.saves))
            return
        for spec in meta.saves:
            self.saving.add(spec.req_id)
            refs = [r for r in spec.pages if self._writes(r)]
            pages += self._pages(refs)
            req_ids += [spec.req_id] * len(refs)
            reused = reused or any(self.groups[r.group].kind != AttentionKind.FULL for r in refs)
            states += sum(self.groups[r.group].kind == AttentionKind.STATE for r in refs)
        self.stats.count("state_values_queued", states)
        # Sliding-window blocks leave the window and go back to vLLM's pool after this step; an
        # offered boundary state's bytes are guaranteed only until the end of this step.
        self._transfers().save(pages, req_ids, reused_next_step=reused)

    def preempted(self, meta: GCacheConnectorMetadata) -> None:
        if meta.preempted:  # their blocks are freed and reused from this step on
            self._transfers().blocks_freed()

    # -- reports ------------------------------------------------------------------------

    def transfer_results(
        self, finished_req_ids: set[str], idle: bool = False, busy_wait_s: float = 0.0
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving). `idle`: the step ran no
        forward, so nobody waits while it waits (bounded) for a load in flight to finish: the
        load is reported in this step rather than the next (and its thread runs meanwhile).
        `busy_wait_s`: a step with a forward waits that long at most (the scheduler's budget):
        a load reported now is scheduled next step instead of a step later."""
        self.finished_saving |= set(finished_req_ids) & self.saving
        transfers = self._transfers()
        wait_s = self.settings.idle_wait_s if idle else busy_wait_s
        if wait_s > 0:
            transfers.wait_loaded(wait_s)
        sent = self.finished_saving - transfers.copies_pending(self.finished_saving)
        self.finished_saving -= sent
        self.saving -= sent
        for req_id, failed in transfers.take_loaded():
            if failed:
                self._failed(req_id, True, failed)
            else:
                self.async_done.add(req_id)
        recving, self.async_done = self.async_done, set()
        failed_recving, self.async_failed = self.async_failed, set()
        return sent, recving, failed_recving

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def flush(self, timeout_s: float) -> bool:
        """Waits (bounded) until every queued save is written: before a process exits."""
        return self.transfers is None or self.transfers.flush(timeout_s)

    def close(self) -> None:
        if self.link is not None:
            link.withdraw(self.engine_id, self.link)
        if self.transfers is not None:
            self.transfers.flush(CLOSE_TIMEOUT_S)
            self.transfers.close(CLOSE_TIMEOUT_S)


def value_worth(group: Group, tokens: int) -> Worth:
    """What a saved value spares an engine, for the node's eviction (the PUT's "worth"):
    a state checkpoint its whole prefix (a hybrid resumes nowhere else without it), an
    attention page its block's tokens (docs/hybrid-models.md, "Which states the node keeps")."""
    if group.kind == AttentionKind.STATE:
        return Worth(ValueKind.STATE_CHECKPOINT, tokens)
    return Worth(ValueKind.ATTENTION_PAGE, group.block_size)
