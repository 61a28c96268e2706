"""RouterCore: pick a worker for a prompt from the local view; keep the view current from Redis.

pick() reads memory only. A background thread (or the caller, synchronously) runs refresh();
when no refresh has succeeded for redis_stale_s (by `clock`), every policy falls back to
least load over this router's own in-flight counts and the last known workers, so no request
fails because Redis is down or slow; the next good refresh resyncs. The same fallback covers
the registration gap after Redis restarts empty: the workers registered before it stay
candidates until they re-register or worker_grace_s passes (state.py). A worker whose
heartbeat lapsed (a stall, or it died) is a candidate only when no registered one is left.
Workers that fail a request are backed off exponentially (backoff_base_s doubling to
backoff_max_s).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gcache.router.config import RouterConfig
from gcache.router.policies import Candidate, Choice, LeastLoad, Mode, Prompt, make_policy
from gcache.router.state import ClusterView, RedisSync
from gcache.serving.announce.bridge import EventBridge
from gcache.serving.announce.engines import GCACHE_WORKER, EngineInfo, EngineKind
from gcache.serving.redis_client import fail_fast_redis
from gcache.serving.redis_layout import Keys, id_bytes, page_ids

log = logging.getLogger("gcache.router")

MODES = tuple(Mode)  # cache, load, capacity, round_robin, random, fallback
REDIS_ERROR_CHARS = 300  # of a Redis error message kept for /health


class RouterCore:
    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.view = ClusterView()
        self.policy = make_policy(config)
        self.fallback = LeastLoad(config)
        self._local = threading.Lock()  # in-flight, backoff, policy state, counters
        self._refreshing = threading.Lock()
        self.inflight: dict[str, int] = {}
        self.inflight_tokens: dict[str, int] = {}
        self.backoff: dict[str, tuple[float, int]] = {}  # url -> (until, consecutive failures)
        self.counters = {f"picks_{m}": 0 for m in MODES}
        self.counters.update(refresh_ok=0, refresh_errors=0, refresh_crashes=0, picks_none=0, failures=0)
        self._last_ok: float | None = None
        self._redis_error: str = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.redis = None
        self.sync: RedisSync | None = None
        self.bridges: list[EventBridge] = []  # this process's --vllm translators, --l3-events subscriber (/metrics)
        if config.redis_url:
            self.redis, _ = fail_fast_redis(config.redis_url, config.redis_timeout_s)
            self.sync = RedisSync(
                self.redis,
                Keys(config.redis_prefix),
                config.workers,
                config.workers_max,
                config.stream_read_max,
                config.l3_pages_max,
                config.worker_grace_s,
                clock,
            )

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self.sync is None or self.config.refresh_interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="router-refresh", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.config.redis_timeout_s + 1)
        if self.redis is not None:
            self.redis.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bug, not Redis: the thread must live on (else: least load forever)
                with self._local:
                    self.counters["refresh_crashes"] += 1
                    first = self.counters["refresh_crashes"] == 1
                if first:
                    log.exception("router: refresh crashed; will keep retrying")
            self._stop.wait(self.config.refresh_interval_s)

    # ---- Redis ---------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Synchronous resync from Redis; True if it answered. Never raises for Redis errors."""
        if self.sync is None:
            return False
        import redis

        with self._refreshing:
            before = set(self.view.workers)
            try:
                if self._redis_error:  # Redis may have restarted empty: re-read the shared L3 too
                    self.sync.reset_l3(self.view)
                self.sync.refresh(self.view, after_error=bool(self._redis_error))
            except (redis.RedisError, OSError, ValueError) as e:
                with self._local:
                    self.counters["refresh_errors"] += 1
                if not self._redis_error:
                    log.warning("router: Redis refresh failed (%s); routing by local least load", e)
                self._redis_error = (str(e) or type(e).__name__)[:REDIS_ERROR_CHARS]
                return False
            gone = before - set(self.view.workers)
            with self._local:
                self.counters["refresh_ok"] += 1
                for url in gone:  # what this router kept about it goes too (bounded by live workers)
                    self.policy.forget(url)
                    if url not in self.inflight:
                        self.backoff.pop(url, None)
            if self._redis_error:
                log.warning("router: Redis is back; view resynced")
            self._redis_error = ""
            self._last_ok = self.clock()
            return True

    def redis_ok(self) -> bool:
        return self._last_ok is not None and self.clock() - self._last_ok <= self.config.redis_stale_s

    # ---- routing -------------------------------------------------------------------------
    def workers(self) -> list[str]:
        """Current candidates, sorted (static list, or the registered workers, see _routable)."""
        with self.view.lock:
            return self._routable()[0]

    def _routable(self) -> tuple[list[str], frozenset]:
        """(candidate URLs sorted, those among them whose registration is missing). Caller
        holds the view lock. Candidates: the registered workers, plus those registered when
        Redis last changed epoch that have not re-registered yet (within their grace); if
        that is nobody, the listed workers whose heartbeat lapsed (within their grace), so
        that a Redis that lost or delayed every registration never leaves us without one."""
        if self.config.workers:
            return list(self.config.workers), frozenset()
        live, back, lapsed = [], [], []
        for u, w in self.view.workers.items():
            if w.reg is None or (self.config.roles and w.reg.role not in self.config.roles):
                continue  # (a PD pool: workers of its role only)
            if w.missing_since is None:
                live.append(u)
            elif w.awaiting:
                back.append(u)
            elif w.listed:
                lapsed.append(u)
        if not live and not back:
            back = lapsed
        return sorted(live + back), frozenset(back)

    def pick(self, tokens, exclude: frozenset = frozenset()) -> str | None:
        """The worker for this prompt (token ids, or a RouteRequest), or None when there is
        none to send it to."""
        choice = self._choose(as_request(tokens), exclude, commit=True)
        return None if choice is None else choice.url

    def explain(self, tokens, exclude: frozenset = frozenset()) -> dict:
        """What the policy sees per worker (read-only): tokens it credits, load, score, picked."""
        choice = self._choose(as_request(tokens), exclude, commit=False)
        if choice is None:
            return {}
        return {u: dict(info, picked=(u == choice.url), mode=choice.mode) for u, info in choice.scores.items()}

    # ---- engines (gcache.serving.announce.engines) -------------------------------------------------
    def tokenizer_key(self, url: str, info: EngineInfo) -> str:
        """How a worker tokenizes: "" = the byte tokenizer (gcache-worker); "hf:NAME" / "hf:" =
        the --tokenizer given for model NAME / the default one (a vLLM server; without any
        --tokenizer for it, its requests carry no tokens: load only). A worker that registered
        nothing is taken for a vLLM server when a default --tokenizer is given."""
        names = self.config.tokenizer_names
        w = self.view.workers.get(url)
        unregistered = w is None or w.reg is None
        if info.kind == EngineKind.VLLM or (unregistered and "" in names):
            for m in info.models:
                if m in names:
                    return "hf:" + m
            return "hf:"  # the default tokenizer (none given: the request routes with no tokens)
        return ""

    def tokenizer_keys(self, model: str | None = None) -> set[str]:
        """The tokenizer keys of the workers a request for `model` could go to."""
        with self.view.lock:
            urls = self._routable()[0]
            served = self._serving(urls, model)
            return {self.tokenizer_key(u, self._info(u)) for u in served}

    def model_served(self, model: str | None) -> bool:
        """False when the request names a model no routable worker serves (404, as vLLM)."""
        with self.view.lock:
            urls = self._routable()[0]
            return not urls or bool(self._serving(urls, model))

    def _names(self, url: str) -> tuple[str, ...]:
        w = self.view.workers.get(url)
        names = w.info.models if w is not None else ()
        return names + (w.reg.model,) if w is not None and w.reg is not None else names

    def _serving(self, urls, model: str | None) -> set:
        """Which of `urls` may take a request naming `model` (caller holds the view lock): any
        when it names none; else those registered under that name; when nobody is, the
        gcache-workers (they answer to any name), never a vLLM server (it would refuse it)."""
        if model is None:
            return set(urls)
        exact = {u for u in urls if model in self._names(u)}
        return exact or {u for u in urls if self._info(u).kind != EngineKind.VLLM}

    def has_engines(self) -> bool:
        """Whether any known worker is a vLLM server (or --tokenizer says unregistered ones are)."""
        if "" in self.config.tokenizer_names:
            return True
        with self.view.lock:
            return any(w.info.kind == EngineKind.VLLM for w in self.view.workers.values())

    def _info(self, url: str) -> EngineInfo:
        w = self.view.workers.get(url)
        return w.info if w is not None else GCACHE_WORKER

    def _choose(self, req: RouteRequest, exclude, commit: bool) -> Choice | None:
        views: dict[str, _TokenView] = {}
        for key, tokens in req.tokens.items():
            views[key] = _TokenView(tokens, allow_empty=bool(key))
        if not views:
            raise ValueError("pick: no tokens")
        first = next(iter(views.values()))
        first.ids_for(self.config.page_size)  # hash outside the locks (the usual page size)
        redis_ok = self.sync is None or self.redis_ok()
        with self.view.lock, self._local:
            cands, healthy, key_of = self._candidates(req, first, views, exclude, redis_ok)
            if not cands:
                self.counters["picks_none"] += 1
                return None
            now = self.clock()
            prompts = {
                k: Prompt(v.num_tokens, v.ids_for, self.view.l3, self.config.page_size, now, req.image)
                for k, v in views.items()
            }
            prompt = next(iter(prompts.values()))
            prompt.views, prompt.key_of = prompts, key_of
            if healthy:
                choice = self.policy.choose(prompt, cands)
            else:
                c = self.fallback.choose(prompt, cands)
                choice = Choice(c.url, Mode.FALLBACK, c.scores)
            if commit:
                self.policy.commit(prompt, choice.url)
                self.counters[f"picks_{choice.mode}"] += 1
            return choice

    def _candidates(self, req, first, views, exclude, redis_ok: bool) -> tuple[list[Candidate], bool, dict]:
        """(candidates, healthy, tokenizer key per candidate). Caller holds both locks. Only
        workers that serve the request's model and whose tokenizer the request was tokenized
        for (a body the byte tokenizer refused never goes to a gcache-worker), and, with
        --length-buckets, those of the prompt's length group. Not healthy (route by local
        least load, no published state): Redis is stale, or a candidate's registration is
        missing. Backed-off workers are left out unless all are (then the one whose backoff
        ends first is the probe)."""
        routable, missing = self._routable()
        key_of = {}
        urls = []
        served = self._serving(routable, req.model)
        for u in routable:
            info = self._info(u)
            k = self.tokenizer_key(u, info)
            if u in exclude or u not in served or k not in views:
                continue
            key_of[u] = k
            urls.append(u)
        if self.config.length_buckets and urls:
            urls = self._bucket(urls, max(v.num_tokens for v in views.values()))
        if not urls:
            return [], redis_ok, key_of
        healthy = redis_ok and not missing.intersection(urls)
        now = self.clock()
        ready = [u for u in urls if self.backoff.get(u, (0.0, 0))[0] <= now]
        if not ready:
            ready = [min(urls, key=lambda u: (self.backoff[u][0], u))]
        key = self._affinity_key(first.arr, first.ids_for)
        out = []
        for u in ready:
            w = self.view.workers.get(u) if healthy else None
            reg = w.reg if w is not None and w.missing_since is None else None
            out.append(
                Candidate(
                    u,
                    zlib.crc32(key, zlib.crc32(u.encode())),
                    self.inflight.get(u, 0),
                    self.inflight_tokens.get(u, 0),
                    reg,
                    w.flags if reg is not None and w is not None else {},  # (reg implies w)
                    self._info(u).kind != EngineKind.VLLM or self._info(u).l3,
                )
            )
        return out, healthy, key_of

    def bucket_of(self, num_tokens: int) -> int:
        """The --length-buckets group of a prompt of num_tokens tokens."""
        return bisect.bisect_right(self.config.length_buckets, num_tokens)

    def _bucket(self, urls: list[str], num_tokens: int) -> list[str]:
        """The workers of the prompt's length group (caller holds the view lock). A worker's
        group is the one its registration names, else its place in the sorted list of the
        workers that name none, spread evenly. An empty group borrows the nearest non-empty
        one, longer first (a long prompt never waits for a group that is not there)."""
        n = len(self.config.length_buckets) + 1
        groups: list[list[str]] = [[] for _ in range(n)]
        unnamed = []
        for u in urls:
            b = self._info(u).bucket
            if b is not None:
                groups[min(b, n - 1)].append(u)
            else:
                unnamed.append(u)
        everyone = sorted(self._routable()[0])  # spread by the full list, so exclusions move nobody
        unplaced = [u for u in everyone if self._info(u).bucket is None]
        for u in unnamed:
            groups[unplaced.index(u) * n // max(1, len(unplaced))].append(u)
        want = self.bucket_of(num_tokens)
        for b in sorted(range(n), key=lambda b: (abs(b - want), b < want)):
            if groups[b]:
                return groups[b]
        return []

    def _affinity_key(self, arr, ids_for) -> bytes:
        """The prompt's identity for tie-breaks: its last whole page id, so equal-score picks
        spread over workers by prompt and a resend lands where the first one went."""
        ids = ids_for(self.config.page_size)
        return id_bytes(ids[-1]) if ids else arr.astype("<u4").tobytes()

    # ---- request outcomes ------------------------------------------------------------------
    def begin(self, url: str, tokens: int = 0) -> None:
        """A request (of `tokens` prompt tokens, if known) is being sent to url."""
        with self._local:
            self.inflight[url] = self.inflight.get(url, 0) + 1
            self.inflight_tokens[url] = self.inflight_tokens.get(url, 0) + max(0, int(tokens))

    def end(self, url: str, ok: bool, tokens: int = 0) -> None:
        """It finished; ok=False (connection error, 5xx) backs the worker off."""
        with self._local:
            n = self.inflight.get(url, 0) - 1
            if n > 0:
                self.inflight[url] = n
                self.inflight_tokens[url] = max(0, self.inflight_tokens.get(url, 0) - max(0, int(tokens)))
            else:
                self.inflight.pop(url, None)
                self.inflight_tokens.pop(url, None)
            if ok:
                self.backoff.pop(url, None)
                return
            self.counters["failures"] += 1
            fails = self.backoff.get(url, (0.0, 0))[1] + 1
            delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** min(fails - 1, 30))
            self.backoff[url] = (self.clock() + delay, fails)

    # ---- observability -----------------------------------------------------------------------
    def health(self) -> dict:
        """redis: off (no Redis) | down (stale: least load) | resync (a candidate has not
        re-registered since Redis lost it: least load) | up."""
        now = self.clock()
        redis_state = "off" if self.sync is None else ("up" if self.redis_ok() else "down")
        with self.view.lock, self._local:
            urls, missing = self._routable()
            if missing and redis_state == "up":
                redis_state = "resync"
            workers = []
            for u in urls:
                w = self.view.workers.get(u)
                until = self.backoff.get(u, (0.0, 0))[0]
                ld = w.reg.load if w is not None and w.reg is not None else None
                workers.append(
                    {
                        "url": u,
                        "registered": u not in missing,
                        "inflight": self.inflight.get(u, 0),
                        "backoff_s": round(max(0.0, until - now), 3),
                        "running": ld.running if ld else None,
                        "waiting": ld.waiting if ld else None,
                        "pages": len(w.flags) if w is not None else 0,
                    }
                )
        return {
            "status": "ok" if workers else "no_workers",
            "policy": self.config.policy,
            "redis": redis_state,
            "redis_error": self._redis_error,
            "workers": workers,
        }

    def metrics_text(self) -> str:
        h = self.health()
        lines = ["# TYPE gcache_router_picks_total counter"]
        with self._local:
            for m in MODES:
                lines.append(f'gcache_router_picks_total{{mode="{m}"}} {self.counters[f"picks_{m}"]}')
            lines.append(f"gcache_router_picks_no_worker_total {self.counters['picks_none']}")
            lines.append(f"gcache_router_worker_failures_total {self.counters['failures']}")
            lines.append(f"gcache_router_refresh_ok_total {self.counters['refresh_ok']}")
            lines.append(f"gcache_router_refresh_errors_total {self.counters['refresh_errors']}")
            lines.append(f"gcache_router_refresh_crashes_total {self.counters['refresh_crashes']}")
        if self.sync is not None:
            for k, v in self.sync.stats.items():
                lines.append(f"gcache_router_sync_{k}_total {v}")
        lines.append(f"gcache_router_redis_up {int(h['redis'] == 'up')}")
        lines.append(f"gcache_router_workers {len(h['workers'])}")
        with self.view.lock:
            lines.append(f"gcache_router_view_pages {self.view.pages()}")
            lines.append(f"gcache_router_view_l3_pages {len(self.view.l3)}")
        for w in h["workers"]:
            lines.append(f'gcache_router_inflight{{worker="{w["url"]}"}} {w["inflight"]}')
        for bridge in self.bridges:
            lines += bridge.metric_lines()
        return "\n".join(lines) + "\n"


@dataclass
class RouteRequest:
    """A request as the router routes it: its prompt under each tokenizer its candidate
    workers use (key "" = the byte tokenizer, "hf:..." = a model's own; an empty list when
    that tokenizer could not render it: no affinity then), the model it names, its first
    image's content hash."""

    tokens: Mapping[str, Sequence[int]]
    model: str | None = None
    image: bytes | None = None


def as_request(tokens) -> RouteRequest:
    return tokens if isinstance(tokens, RouteRequest) else RouteRequest({"": tokens})


class _TokenView:
    """One tokenization of the prompt: checked ids and page ids per page size (lazy)."""

    def __init__(self, tokens, allow_empty: bool) -> None:
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise ValueError("pick: tokens must be a sequence of token ids") from None
        if arr.ndim != 1 or (arr.size == 0 and not allow_empty):
            raise ValueError("pick: tokens must be a non-empty 1-D sequence of ids in [0, 2^32)")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise ValueError("pick: tokens must be a non-empty 1-D sequence of ids in [0, 2^32)")
        self.arr = arr
        self.num_tokens = max(1, int(arr.size))
        self._ids: dict[int, list[int]] = {}

    def ids_for(self, ps: int) -> list[int]:
        if ps not in self._ids:
            self._ids[ps] = page_ids(self.arr, ps) if self.arr.size else []
        return self._ids[ps]
