"""`gcache-router`'s HTTP front: the worker API, proxied to the worker RouterCore picks.

Per request: read the body (deadline, 8 MiB limit, no slot held meanwhile), parse it
(400 for malformed JSON or a body the workers would refuse to tokenize), take an
in-flight slot (503 when none), tokenize it exactly as a worker would
(openai_api.prompt_tokens) and ask core.pick(). The body goes to the worker unchanged;
the worker's answer comes back chunk by chunk as it arrives (a stream is never buffered),
with `x-gcache-worker: <url>` added. The request body is the only thing held per
connection (kept for the retry).

Retry: when the chosen worker fails before its response headers (connection refused or
reset, or a 500/502/503), the request goes once to another worker (completions are
deterministic, so a retry is safe); if that also fails, the client gets a 503 naming both
failures (a 5xx from the second worker is passed through as it is). A worker that does
not answer within --request-timeout-s gets no retry (the client's time is spent): 504.
A worker that dies after its headers were sent cannot be retried: a stream gets an error
event, a plain body is cut short (the connection is closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from gcache.router.core import RouterCore, RouteRequest, as_request
from gcache.router.engine_prompts import ModelTokenizer, NotRenderable, first_image, request_model
from gcache.serving import sse
from gcache.serving.body import BODY_BYTES_MAX, BODY_DEADLINE_S
from gcache.serving.counters import HTTPCounters, prometheus_response
from gcache.serving.errors import HTTPError, error_body, error_response, from_http_error, json_response
from gcache.serving.intake import openai_app, serve_post
from gcache.serving.limiter import InFlightLimiter
from gcache.serving.openai_api import CHAT_PATH, COMPLETIONS_PATH, prompt_tokens
from gcache.serving.safe_json import parse_json
from gcache.serving.tokenizer import ByteTokenizer

log = logging.getLogger("gcache.router")

WORKER_HEADER = "x-gcache-worker"
RETRY_STATUSES = (500, 502, 503)
ROUTER_VOCAB = 1 << 31  # token-id prompts are range-checked by the worker, which knows its vocabulary
ERROR_PEEK_BYTES = 4096  # of a failed worker's answer, for the 503 message
RELAYED_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering")
ROUTER_COUNTERS = {
    "http_retries_total": "requests sent to a second worker after the first failed before answering",
    "http_upstream_errors_total": "worker attempts that failed (connection error, 5xx, timeout, broken stream)",
    "http_no_worker_total": "requests answered 503: no worker to send them to, or both attempts failed",
    "http_rejected_in_flight_total": "requests answered 503 because every --max-in-flight slot was taken",
    "http_body_timeouts_total": "requests whose body did not arrive within --body-timeout-s (408)",
    "http_broken_answers_total": "answers cut short: the worker failed after its headers were relayed",
    "http_client_gone_total": "answers cut short: the client went away",
    "http_unknown_model_total": "requests answered 404: no worker serves the model they name",
    "http_untokenized_total": "requests a model's tokenizer could not render (routed without affinity)",
}


@dataclass(frozen=True)
class Intake:
    payload: dict
    tokens: list[int] | None  # the byte tokenizer's prompt (gcache-workers); None: it refused the body
    error: HTTPError | None  # ... and why
    model: str | None
    image: bytes | None  # the first image's content hash


class WorkerFailed(Exception):
    """An attempt failed before the worker's response headers: worth a retry elsewhere."""


class RouterApp:
    def __init__(
        self,
        core: RouterCore,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 2.0,
        max_in_flight: int = 1024,
        body_timeout_s: float = BODY_DEADLINE_S,
        body_bytes_max: int = BODY_BYTES_MAX,
        tokenizers: dict | None = None,
    ) -> None:
        self.core = core
        self.request_timeout_s, self.connect_timeout_s = request_timeout_s, connect_timeout_s
        self.body_timeout_s, self.body_bytes_max = body_timeout_s, body_bytes_max
        self.limiter = InFlightLimiter(max_in_flight)
        self.tok = ByteTokenizer(ROUTER_VOCAB)
        self.tokenizers = tokenizers if tokenizers is not None else load_tokenizers(core.config)
        self.counters = HTTPCounters(
            "gcache_router_", (COMPLETIONS_PATH, CHAT_PATH, "/health", "/metrics"), ROUTER_COUNTERS
        )
        self.session: aiohttp.ClientSession | None = None

    def build(self) -> web.Application:
        app = openai_app(
            self.counters, log, self.body_bytes_max, self.completions, self.chat, self.health, self.metrics
        )
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=2 * self.limiter.limit, limit_per_host=0)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("Accept-Encoding",)
        )

    async def _close_session(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # ---- GET ------------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        h = self.core.health()
        h["in_flight"] = self.limiter.in_flight
        return json_response(200 if h.get("status") == "ok" else 503, h)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.core.metrics_text() + self.counters.render(
            {"http_in_flight": ("requests this router is proxying now", self.limiter.in_flight)}
        )
        return prometheus_response(text)

    # ---- POST -----------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, COMPLETIONS_PATH)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, CHAT_PATH)

    async def _proxy(self, request: web.Request, path: str) -> web.StreamResponse:
        async def attempts(body: bytes, intake: Intake) -> web.StreamResponse:
            return await self._route(request, path, body, intake)

        return await serve_post(
            request,
            lambda payload: self._intake(path, payload),
            attempts,
            limiter=self.limiter,
            counters=self.counters,
            body_bytes_max=self.body_bytes_max,
            body_timeout_s=self.body_timeout_s,
        )

    def _intake(self, path: str, payload) -> Intake:
        """What routing needs from a body. The byte tokenizer's parse (gcache-workers') refusing
        it is a 400 unless vLLM servers may take it (they decide what is valid)."""
        try:
            tokens, error = prompt_tokens(path, payload, self.tok), None
        except HTTPError as e:
            if not isinstance(payload, dict) or not self.core.has_engines():
                raise
            tokens, error = None, e
        image = first_image(payload) if path == CHAT_PATH else None
        return Intake(payload, tokens, error, request_model(payload), image)

    async def _route(self, request: web.Request, path: str, body: bytes, intake: Intake) -> web.StreamResponse:
        if not self.core.model_served(intake.model):
            self.counters.inc("http_unknown_model_total")
            return error_response(404, f"The model `{intake.model}` does not exist.")
        tokens: dict[str, list[int]] = {}
        for key in sorted(self.core.tokenizer_keys(intake.model)):
            if not key:
                if intake.tokens is not None:
                    tokens[key] = intake.tokens
                continue
            tokens[key] = await self._engine_tokens(key, path == CHAT_PATH, intake.payload)
        if not tokens:  # only gcache-workers could take it, and their parse refused it
            if intake.error is not None:
                return from_http_error(intake.error)
            return await self._attempts(request, path, body, RouteRequest({"": [0]}, intake.model))
        return await self._attempts(request, path, body, RouteRequest(tokens, intake.model, intake.image))

    async def _engine_tokens(self, key: str, chat: bool, payload: dict) -> list[int]:
        """The prompt as the engines of tokenizer `key` see it ([] if it cannot be rendered)."""
        tok = self.tokenizers.get(key[3:])
        if tok is None:
            return []
        try:
            return await asyncio.get_running_loop().run_in_executor(None, tok.tokens, chat, payload)
        except NotRenderable:
            self.counters.inc("http_untokenized_total")
            return []
        except Exception:  # a tokenizer bug must not fail the request: route it without affinity
            self.counters.inc("http_untokenized_total")
            log.exception("router: tokenizer %r failed", key)
            return []

    async def _attempts(
        self, request: web.Request, path: str, body: bytes, req: RouteRequest | Sequence[int]
    ) -> web.StreamResponse:
        req = as_request(req)  # (a subclass may pass plain token ids)
        tried: list[str] = []
        failures: list[str] = []
        tokens = max(req.tokens.values(), key=len)
        for attempt in range(2):
            url = self.core.pick(req, exclude=frozenset(tried))
            if url is None:
                break
            if attempt:
                self.counters.inc("http_retries_total")
            tried.append(url)
            try:
                return await self._forward(request, url, path, body, len(tokens), last=attempt == 1)
            except WorkerFailed as e:
                failures.append(str(e))
        self.counters.inc("http_no_worker_total")
        if not failures:
            return error_response(503, "no worker available to take the request")
        return error_response(503, "no worker could take the request: " + "; ".join(failures))

    async def _forward(
        self, request: web.Request, url: str, path: str, body: bytes, n_tokens: int, last: bool
    ) -> web.StreamResponse:
        """One attempt on `url`. WorkerFailed: nothing was sent to the client; try elsewhere."""
        self.core.begin(url, n_tokens)
        ok = False
        try:
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s)
            if self.session is None:  # cannot happen: opened on the app's startup
                raise RuntimeError("invariant broken: opened on the app's startup")
            try:
                upstream = await self.session.post(
                    url + path, data=body, timeout=timeout, headers={"Content-Type": "application/json"}
                )
            except asyncio.TimeoutError:
                self.counters.inc("http_upstream_errors_total")
                return error_response(
                    504,
                    f"worker {url} did not answer within {self.request_timeout_s:g} s",
                    headers={WORKER_HEADER: url},
                )
            except (aiohttp.ClientError, OSError) as e:
                self.counters.inc("http_upstream_errors_total")
                raise WorkerFailed(f"{url}: {_describe(e)}") from None
            try:
                if upstream.status in RETRY_STATUSES and not last:
                    self.counters.inc("http_upstream_errors_total")
                    raise WorkerFailed(f"{url}: HTTP {upstream.status}: {await _peek_message(upstream)}")
                resp, complete = await self._relay(request, upstream, url)
                ok = complete and upstream.status < 500
                return resp
            except ConnectionError:
                ok = True  # the client went away: not the worker's fault
                self.counters.inc("http_client_gone_total")
                raise
            finally:
                upstream.close()  # an answer not read to the end closes its connection: the worker cancels
        finally:
            self.core.end(url, ok, n_tokens)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, url: str
    ) -> tuple[web.StreamResponse, bool]:
        """Copy the worker's answer to the client as it arrives; False if the worker broke off.
        ConnectionError: the client went away."""
        headers = {h: upstream.headers[h] for h in RELAYED_HEADERS if h in upstream.headers}
        headers[WORKER_HEADER] = url
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if upstream.content_length is not None and not streaming:
            resp.content_length = upstream.content_length
        await resp.prepare(request)
        chunks = upstream.content.iter_any().__aiter__()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.counters.inc("http_upstream_errors_total")
                self.counters.inc("http_broken_answers_total")
                if streaming:  # tell an SSE client why its stream ends here
                    await resp.write(sse.event(error_body(502, f"worker {url} failed mid-answer: {_describe(e)}")))
                    await resp.write(sse.DONE)
                    await resp.write_eof()
                else:
                    resp.force_close()  # a cut body must not look complete
                return resp, False
            await resp.write(chunk)  # waits while the client is slower than the worker
        await resp.write_eof()
        return resp, True


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def _peek_message(upstream: aiohttp.ClientResponse) -> str:
    """The error message of a failed worker's answer (bounded read; best effort)."""
    try:
        raw = await asyncio.wait_for(upstream.content.read(ERROR_PEEK_BYTES), 2.0)
        obj = parse_json(raw)
        return str(obj["error"]["message"])
    except Exception:  # noqa: BLE001 - a message is a nicety; the status says enough
        return "(no message)"


def load_tokenizers(config) -> dict:
    """--tokenizer's model directories, loaded (ValueError for a bad one): name -> tokenizer."""
    return {name: ModelTokenizer(path) for name, path in config.tokenizers}


def make_app(
    core: RouterCore,
    request_timeout_s: float = 600.0,
    connect_timeout_s: float = 2.0,
    max_in_flight: int = 1024,
    body_timeout_s: float = BODY_DEADLINE_S,
    body_bytes_max: int = BODY_BYTES_MAX,
    tokenizers: dict | None = None,
) -> web.Application:
    return RouterApp(
        core, request_timeout_s, connect_timeout_s, max_in_flight, body_timeout_s, body_bytes_max, tokenizers
    ).build()
