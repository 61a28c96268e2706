"""The router's view of the workers, rebuilt and kept current from Redis.

Per worker: its registration (geometry, load, epoch, seq) and its page flags. Sync rule
(see layout.py for the keys):
  * registration epoch differs from ours -> full load: one MULTI reads the registration, the
    page hash and the stream's last entry id, an atomic snapshot and where it sits in the stream;
  * same epoch, newer seq -> XRANGE after our last entry id; an entry from another epoch or a
    seq gap (the stream was trimmed past us) -> full load next.
So a router's view is a function of Redis contents: a late router rebuilds the same one.
A worker whose registration stays missing for worker_grace_s (router clock) is dropped.

Redis epochs: when Redis restarts (its run_id changes, or it answers again after failing)
it may have lost every key. The workers registered just before are marked `awaiting`:
until they re-register (their publisher resyncs within about a second) or their grace
ends, the core keeps routing to them (core.py), so no request fails because of the gap.

Fetching happens without the view lock; applying takes it for bounded memory work only
(one registration pass, one stream entry, one chunk of L3 reports at a time), so pick()
never waits on Redis.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from gcache.serving.announce.engines import GCACHE_WORKER, EngineInfo, parse_info
from gcache.serving.redis_layout import (
    FLAGS_ALL,
    L3_FULL,
    L3_SWA,
    Keys,
    Registration,
    decode_records,
    id_from_bytes,
    valid_worker_url,
)

L3_SKEW_MS = 2_000  # re-read this much of the L3 log on each refresh (workers' clocks differ)
L3_APPLY_CHUNK = 20_000  # L3 reports applied per hold of the view lock (pick() waits for one chunk at most)


@dataclass
class WorkerView:
    url: str
    reg: Registration | None = None
    flags: dict = field(default_factory=dict)  # page id -> L1/L2 flags
    epoch: str = ""
    seq: int = -1
    last_id: bytes | None = None  # stream id of the entry at `seq`
    missing_since: float | None = None  # router clock when the registration went missing
    listed: bool = True  # in the discovery set (False: deregistered, or Redis lost it)
    awaiting: bool = False  # registered when Redis changed epoch: expected back
    info: EngineInfo = GCACHE_WORKER  # the engine behind it (engines.py)


class ClusterView:
    """What pick() reads. Mutated only under `lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: dict[str, WorkerView] = {}
        self.l3: OrderedDict[int, int] = OrderedDict()  # page id -> L3_FULL | L3_SWA
        self.l3_since_ms: int | None = None  # newest L3 report applied

    def pages(self) -> int:
        return sum(len(w.flags) for w in self.workers.values())


def _apply_records(flags: dict, records) -> None:
    for pid, f in records:
        if f:
            flags[pid] = f
        else:
            flags.pop(pid, None)


def _l3_member_ok(member: bytes, score: float) -> bool:
    """What a publisher writes: an 8-byte page id scored by a report time (anything else is skipped)."""
    return len(member) == 8 and math.isfinite(score)


class RedisSync:
    def __init__(
        self,
        client,
        keys: Keys,
        static_workers: tuple[str, ...],
        workers_max: int,
        stream_read_max: int,
        l3_pages_max: int,
        grace_s: float,
        clock,
    ) -> None:
        self.r, self.keys = client, keys
        self.static = static_workers
        self.workers_max, self.stream_read_max = workers_max, stream_read_max
        self.l3_pages_max, self.grace_s, self.clock = l3_pages_max, grace_s, clock
        self.run_id: str | None = None  # Redis's run_id at the last refresh (None: unknown)
        self.stats = dict.fromkeys(
            (
                "full_loads",
                "deltas",
                "stream_gaps",
                "bad_entries",
                "bad_registrations",
                "bad_worker_urls",
                "workers_dropped",
                "l3_reads",
                "l3_removed",
                "redis_epochs",
            ),
            0,
        )

    # ---- one refresh -------------------------------------------------------------------
    def refresh(self, view: ClusterView, after_error: bool = False) -> None:
        """Bring `view` up to date with Redis. Raises redis errors (nothing applied then,
        except whole steps already done, each of which leaves the view consistent).
        after_error: the previous refresh failed (Redis may have restarted empty)."""
        urls, run_id = self._discover()
        new_epoch = after_error or (run_id is not None and self.run_id is not None and run_id != self.run_id)
        regs, infos = self._registrations(urls)
        now = self.clock()
        full, delta = [], []
        with view.lock:
            if new_epoch:  # Redis restarted, or answers again: it may have lost every key
                self.stats["redis_epochs"] += 1
                for worker in view.workers.values():
                    worker.awaiting = worker.awaiting or worker.missing_since is None
            if run_id is not None:
                self.run_id = run_id
            for url in urls:
                w = view.workers.get(url)
                reg = regs.get(url)
                if reg is None:
                    if w is not None:
                        w.listed = True  # listed, heartbeat lapsed (a stall, or it died)
                        if w.missing_since is None:
                            w.missing_since = now
                    continue
                if w is None:
                    w = view.workers[url] = WorkerView(url)
                w.missing_since, w.listed, w.awaiting = None, True, False
                w.reg, w.info = reg, infos[url]
                if reg.epoch != w.epoch or w.last_id is None or reg.seq < w.seq:
                    full.append(url)
                elif reg.seq > w.seq:
                    delta.append((url, w.last_id))
            self._drop_missing(view, set(urls), now)
        for url in full:
            self._full_load(view, url)
        self._deltas(view, delta)
        self._l3(view)

    def _discover(self) -> tuple[list[str], str | None]:
        """(worker URLs, Redis run_id or None if INFO is not allowed). One round trip."""
        p = self.r.pipeline(transaction=False)
        if not self.static:
            p.zrevrange(self.keys.workers, 0, self.workers_max - 1)
        p.info("server")
        results = p.execute(raise_on_error=False)
        info = results[-1]
        run_id = str(info["run_id"]) if isinstance(info, dict) and "run_id" in info else None
        if self.static:
            return list(self.static), run_id
        if isinstance(results[0], Exception):
            raise results[0]
        urls = []
        for raw in results[0]:
            url = raw.decode("ascii", "replace")
            if valid_worker_url(url):
                urls.append(url)
            else:  # what no publisher writes: skip it (it must not take routing down)
                self.stats["bad_worker_urls"] += 1
        return sorted(urls), run_id

    def _registrations(self, urls: list[str]) -> tuple[dict[str, Registration], dict[str, EngineInfo]]:
        if not urls:
            return {}, {}
        out, infos = {}, {}
        for url, raw in zip(urls, self.r.mget([self.keys.reg(u) for u in urls])):
            if raw is None:
                continue
            try:
                reg = Registration.from_json(raw)
            except ValueError:
                self.stats["bad_registrations"] += 1
                continue
            if reg.url != url:
                self.stats["bad_registrations"] += 1
                continue
            out[url] = reg
            infos[url] = parse_info(raw)
        return out, infos

    def _drop_missing(self, view: ClusterView, listed: set, now: float) -> None:
        for url, w in list(view.workers.items()):
            gone = url not in listed and not self.static
            if gone:
                w.listed = False
                if w.missing_since is None:
                    w.missing_since = now
            if w.missing_since is not None and now - w.missing_since >= self.grace_s:
                del view.workers[url]
                self.stats["workers_dropped"] += 1

    # ---- worker pages ------------------------------------------------------------------
    def _full_load(self, view: ClusterView, url: str) -> None:
        p = self.r.pipeline(transaction=True)
        p.get(self.keys.reg(url))
        p.hgetall(self.keys.pages(url))
        p.xrevrange(self.keys.events(url), count=1)
        reg_raw, pages, last = p.execute()
        self.stats["full_loads"] += 1
        if reg_raw is None:
            return
        try:
            reg = Registration.from_json(reg_raw)
        except ValueError:
            self.stats["bad_registrations"] += 1
            return
        flags = {}
        for k, v in pages.items():
            if len(k) == 8 and len(v) == 1 and v[0] & FLAGS_ALL:
                flags[id_from_bytes(k)] = v[0] & FLAGS_ALL
        last_id = None  # None: no delta can follow this snapshot; the next refresh reloads it
        if last:
            entry_id, fields = last[0]
            try:
                if fields.get(b"e", b"").decode() == reg.epoch and int(fields.get(b"s", -1)) == reg.seq:
                    last_id = entry_id
            except ValueError:
                self.stats["bad_entries"] += 1
        with view.lock:
            w = view.workers.get(url)
            if w is None:
                return
            w.reg, w.flags, w.epoch, w.seq, w.last_id = reg, flags, reg.epoch, reg.seq, last_id
            w.info = parse_info(reg_raw)

    def _deltas(self, view: ClusterView, todo: list) -> None:
        if not todo:
            return
        p = self.r.pipeline(transaction=False)
        for url, last_id in todo:
            p.xrange(self.keys.events(url), min=b"(" + last_id, max="+", count=self.stream_read_max)
        results = p.execute()
        for (url, _), entries in zip(todo, results):
            for entry_id, fields in entries:
                try:  # decoded outside the lock; each entry applied under it (one flush's worth)
                    epoch = fields.get(b"e", b"").decode()
                    seq = int(fields.get(b"s", -1))
                    records = decode_records(fields.get(b"d", b""))
                except ValueError:
                    epoch, seq, records = None, -1, None
                with view.lock:
                    w = view.workers.get(url)
                    if w is None or w.last_id is None:
                        break
                    if records is None:  # not what a publisher writes: start over from the snapshot
                        self.stats["bad_entries"] += 1
                        w.last_id = None
                        break
                    if epoch != w.epoch or seq != w.seq + 1:
                        self.stats["stream_gaps"] += 1
                        w.last_id = None  # full load on the next refresh
                        break
                    _apply_records(w.flags, records)
                    w.seq, w.last_id = seq, entry_id
                    self.stats["deltas"] += 1

    # ---- the shared L3 -----------------------------------------------------------------
    def _l3(self, view: ClusterView) -> None:
        """The shared L3 view: everything on the first read, then what was added or removed
        since (the :gone sets, gcache.serving.announce.l3_view). A page is in at most one of a set and
        its :gone set at a time, so one read's adds and removals never contradict."""
        since = view.l3_since_ms
        k = self.keys
        p = self.r.pipeline(transaction=True)
        for key in (k.l3_full, k.l3_swa):
            if since is None:
                p.zrevrange(key, 0, self.l3_pages_max - 1, withscores=True)
            else:
                p.zrangebyscore(key, since - L3_SKEW_MS, "+inf", start=0, num=self.l3_pages_max, withscores=True)
        if since is not None:
            for key in (k.l3_full_gone, k.l3_swa_gone):
                p.zrangebyscore(key, since - L3_SKEW_MS, "+inf", start=0, num=self.l3_pages_max, withscores=True)
        full, swa, *gone = p.execute()
        self.stats["l3_reads"] += 1
        items = [(int(s), id_from_bytes(m), L3_FULL) for m, s in full if _l3_member_ok(m, s)]
        items += [(int(s), id_from_bytes(m), L3_SWA) for m, s in swa if _l3_member_ok(m, s)]
        removals = []
        for bit, entries in zip((L3_FULL, L3_SWA), gone):
            removals += [(int(s), id_from_bytes(m), -bit) for m, s in entries if _l3_member_ok(m, s)]
        items.sort()
        for i in range(0, len(items), L3_APPLY_CHUNK):
            with view.lock:
                l3 = view.l3
                for score, pid, bit in items[i : i + L3_APPLY_CHUNK]:
                    l3[pid] = l3.get(pid, 0) | bit
                    l3.move_to_end(pid)
                while len(l3) > self.l3_pages_max:
                    l3.popitem(last=False)
        for i in range(0, len(removals), L3_APPLY_CHUNK):
            with view.lock:
                l3 = view.l3
                for _, pid, bit in removals[i : i + L3_APPLY_CHUNK]:
                    left = l3.get(pid, 0) & ~-bit
                    if left:
                        l3[pid] = left
                    elif l3.pop(pid, None) is not None:
                        self.stats["l3_removed"] += 1
        newest = max([x[0] for x in items[-1:]] + [x[0] for x in removals], default=None)
        with view.lock:  # only once everything is in: a failed read re-reads from the old mark
            if newest is not None:
                view.l3_since_ms = max(newest, view.l3_since_ms or 0)
            elif view.l3_since_ms is None:
                view.l3_since_ms = 0

    def reset_l3(self, view: ClusterView) -> None:
        """After a Redis outage (it may have restarted empty): reload L3 from scratch."""
        with view.lock:
            view.l3.clear()
            view.l3_since_ms = None
