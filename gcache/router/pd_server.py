"""`gcache-router --pd`: one OpenAI answer from two workers, a prefill and a decode one.

Per request (after the same intake as server.py):
  1. bypass: a prompt shorter than --pd-min-prompt-tokens, or L3 reported down in the last
     --pd-l3-down-s, is served whole by a decode worker (RouterApp's own path, its retry);
  2. prefill: POST /pd/prefill to the prefill worker the cache-aware policy picks (a prefix
     it or L3 has is not recomputed); a worker that fails or does not answer within
     --pd-prefill-timeout-s is replaced once by another, then the client gets a 503. A
     worker that answers "L3 down" sends the request down path 1 (and the next ones for a while);
  3. decode: the handoff goes to the decode worker the load policy picks (POST /pd/decode),
     retried once on another while nothing of its answer was relayed. A stream's role and
     first-token chunks come from the prefill answer, written before the decode worker is
     even asked; the decode worker's stream follows from its second token on, so the client
     sees every token once. A decode worker that breaks off mid-stream ends the stream with
     an error event and [DONE] (never a hang: every read has --request-timeout-s).
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from gcache.common.breaker import Breaker
from gcache.router.core import RouterCore
from gcache.router.pd_config import PDConfig
from gcache.router.server import RETRY_STATUSES, ROUTER_COUNTERS, RouterApp, WorkerFailed, _describe, _peek_message
from gcache.serving import sse
from gcache.serving.body import BODY_BYTES_MAX
from gcache.serving.counters import HTTPCounters, prometheus_response
from gcache.serving.errors import error_body, error_response, from_http_error, json_response
from gcache.serving.handoff import PD_DECODE_PATH, PD_PREFILL_PATH
from gcache.serving.openai_api import CHAT_PATH, COMPLETIONS_PATH
from gcache.serving.safe_json import parse_json

log = logging.getLogger("gcache.router")

L3_DOWN_HEADER = "x-gcache-pd"  # the prefill worker's "l3-down" (gcache.worker.http.pd_routes)
PREFILL_HEADER = "x-gcache-prefill-worker"
PD_COUNTERS = {
    "pd_requests_total": "requests served as prefill + decode",
    "pd_bypass_total": "requests served whole by a decode worker (short prompt)",
    "pd_l3_down_fallback_total": "requests served whole by a decode worker because L3 was reported down",
    "pd_prefill_retries_total": "prefill attempts repeated on another prefill worker",
    "pd_prefill_failed_total": "requests answered 503: no prefill worker could take them",
    "pd_decode_retries_total": "handoffs sent to a second decode worker",
    "pd_answered_by_prefill_total": "requests whose first token ended them (no decode needed)",
}


class L3Down(Exception):
    """The prefill worker cannot hand over: its L3 is unavailable."""


class PDRouterApp(RouterApp):
    """RouterApp over the decode pool (plain requests, bypass, fallback) plus a prefill pool."""

    def __init__(self, decode_core: RouterCore, prefill_core: RouterCore, pd: PDConfig, **kw) -> None:
        super().__init__(decode_core, **kw)
        self.prefill_core, self.pd = prefill_core, pd
        self.l3_down = Breaker(pd.l3_down_s)
        self.counters = HTTPCounters(
            "gcache_router_", (COMPLETIONS_PATH, CHAT_PATH, "/health", "/metrics"), {**ROUTER_COUNTERS, **PD_COUNTERS}
        )

    async def health(self, request: web.Request) -> web.Response:
        pre, dec = self.prefill_core.health(), self.core.health()
        ok = pre.get("status") == "ok" and dec.get("status") == "ok"
        body = {"status": "ok" if ok else "no_workers", "in_flight": self.limiter.in_flight}
        return json_response(200 if ok else 503, {**body, "prefill": pre, "decode": dec})

    async def metrics(self, request: web.Request) -> web.Response:
        pre = self.prefill_core.metrics_text().replace("gcache_router_", "gcache_router_prefill_")
        text = self.core.metrics_text() + pre
        text += self.counters.render(
            {"http_in_flight": ("requests this router is proxying now", self.limiter.in_flight)}
        )
        return prometheus_response(text)

    # ---- the PD path --------------------------------------------------------------------------
    async def _route(self, request: web.Request, path: str, body: bytes, intake) -> web.StreamResponse:
        """PD pools are gcache-workers: the byte tokenizer's prompt (vLLM servers are not pooled)."""
        if intake.tokens is None:
            return from_http_error(intake.error)
        return await self._attempts(request, path, body, intake.tokens)

    async def _attempts(self, request: web.Request, path: str, body: bytes, tokens) -> web.StreamResponse:  # type: ignore[override]
        if path not in (COMPLETIONS_PATH, CHAT_PATH):  # RouterApp's own retry calls this for /pd/decode too
            return await super()._attempts(request, path, body, tokens)
        if len(tokens) < self.pd.min_prompt_tokens:
            self.counters.inc("pd_bypass_total")
            return await super()._attempts(request, path, body, tokens)
        if self.l3_down.is_suspect():
            self.counters.inc("pd_l3_down_fallback_total")
            return await super()._attempts(request, path, body, tokens)
        payload = parse_json(body)  # parsed once already by the intake: valid
        try:
            first = await self._prefill(json.dumps({"path": path, "request": payload}).encode(), len(tokens), tokens)
        except L3Down:
            self.l3_down.fail()
            self.counters.inc("pd_l3_down_fallback_total")
            return await super()._attempts(request, path, body, tokens)
        if isinstance(first, web.StreamResponse):
            return first
        self.counters.inc("pd_requests_total")
        stream = payload.get("stream") is True
        if first.get("done"):
            self.counters.inc("pd_answered_by_prefill_total")
            return await self._answer_done(request, first, stream)
        handoff_body = json.dumps({"path": path, "request": payload, "handoff": first["handoff"]}).encode()
        if not stream:  # one body: RouterApp's relay and retry, on /pd/decode
            return await super()._attempts(request, PD_DECODE_PATH, handoff_body, tokens)
        return await self._decode_stream(request, first, handoff_body, tokens)

    async def _prefill(self, body: bytes, n_tokens: int, tokens: list[int]):
        """The prefill answer (a dict), or a response to give the client (4xx, 503)."""
        tried: list[str] = []
        failures: list[str] = []
        for attempt in range(2):
            url = self.prefill_core.pick(tokens, exclude=frozenset(tried))
            if url is None:
                break
            if attempt:
                self.counters.inc("pd_prefill_retries_total")
            tried.append(url)
            try:
                return await self._prefill_once(url, body, n_tokens)
            except WorkerFailed as e:
                failures.append(str(e))
        self.counters.inc("pd_prefill_failed_total")
        why = "; ".join(failures) if failures else "no prefill worker available"
        return error_response(503, f"no prefill worker could take the request: {why}")

    async def _prefill_once(self, url: str, body: bytes, n_tokens: int):
        core, ok = self.prefill_core, False
        core.begin(url, n_tokens)
        try:
            timeout = aiohttp.ClientTimeout(total=self.pd.prefill_timeout_s, sock_connect=self.connect_timeout_s)
            if self.session is None:  # cannot happen: opened on the app's startup
                raise RuntimeError("invariant broken: opened on the app's startup")
            try:
                async with self.session.post(
                    url + PD_PREFILL_PATH, data=body, timeout=timeout, headers={"Content-Type": "application/json"}
                ) as up:
                    if up.headers.get(L3_DOWN_HEADER) == "l3-down":
                        ok = True  # the worker is fine; its store is not
                        raise L3Down(url)
                    if up.status in RETRY_STATUSES:
                        raise WorkerFailed(f"{url}: HTTP {up.status}: {await _peek_message(up)}")
                    raw = await up.content.read(BODY_BYTES_MAX + 1)
            except asyncio.TimeoutError:
                raise WorkerFailed(f"{url}: no prefill answer within {self.pd.prefill_timeout_s:g} s") from None
            except (aiohttp.ClientError, OSError) as e:
                raise WorkerFailed(f"{url}: {_describe(e)}") from None
            if len(raw) > BODY_BYTES_MAX:
                raise WorkerFailed(f"{url}: prefill answer over {BODY_BYTES_MAX} bytes")
            ok = True
            if up.status != 200:  # the request's fault (a 400): the client gets it as it is
                return web.Response(status=up.status, body=raw, content_type="application/json")
            answer = parse_json(raw)
            if not isinstance(answer, dict) or ("handoff" not in answer and not answer.get("done")):
                ok = False
                raise WorkerFailed(f"{url}: malformed prefill answer")
            answer["prefill_url"] = url
            return answer
        except WorkerFailed:
            self.counters.inc("http_upstream_errors_total")
            raise
        finally:
            core.end(url, ok, n_tokens)

    async def _answer_done(self, request: web.Request, first: dict, stream: bool) -> web.StreamResponse:
        if not stream:
            return json_response(200, first["body"], headers={PREFILL_HEADER: first["prefill_url"]})
        resp = await sse.start(request, headers={PREFILL_HEADER: first["prefill_url"]})
        for ev in first.get("events", []):
            await resp.write(sse.event(ev))
        await resp.write(sse.DONE)
        await resp.write_eof()
        return resp

    async def _decode_stream(self, request: web.Request, first: dict, body: bytes, tokens: list[int]):
        resp = await sse.start(request, headers={PREFILL_HEADER: first["prefill_url"]})
        for ev in first["events"]:  # the role and the first token: the client's TTFT is the prefill's
            await resp.write(sse.event(ev))
        tried: list[str] = []
        failures: list[str] = []
        for attempt in range(2):
            url = self.core.pick(tokens, exclude=frozenset(tried))
            if url is None:
                break
            if attempt:
                self.counters.inc("pd_decode_retries_total")
            tried.append(url)
            try:
                await self._relay_decode(resp, url, body, len(tokens))
                return resp
            except WorkerFailed as e:
                failures.append(str(e))
            except ConnectionError:
                self.counters.inc("http_client_gone_total")
                raise
        why = "; ".join(failures) if failures else "no decode worker available"
        await self._end_with_error(resp, 503, f"no decode worker could continue the request: {why}")
        return resp

    async def _relay_decode(self, resp: web.StreamResponse, url: str, body: bytes, n_tokens: int) -> None:
        """Relay one decode worker's stream. WorkerFailed: nothing of it was relayed (retry);
        once bytes went out, a failure ends the stream with an error event instead."""
        self.core.begin(url, n_tokens)
        ok = False
        try:
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s)
            if self.session is None:  # cannot happen: opened on the app's startup
                raise RuntimeError("invariant broken: opened on the app's startup")
            try:
                up = await self.session.post(
                    url + PD_DECODE_PATH, data=body, timeout=timeout, headers={"Content-Type": "application/json"}
                )
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                self.counters.inc("http_upstream_errors_total")
                raise WorkerFailed(f"{url}: {_describe(e)}") from None
            try:
                if up.status in RETRY_STATUSES:
                    self.counters.inc("http_upstream_errors_total")
                    raise WorkerFailed(f"{url}: HTTP {up.status}: {await _peek_message(up)}")
                if not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                    ok = True  # a 4xx about the handoff: the client learns why
                    await self._end_with_error(resp, up.status, await _peek_message(up))
                    return
                tail = b""
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                    tail = (tail + chunk)[-len(sse.DONE) :]
                if tail != sse.DONE:  # a body closed early looks complete to HTTP: [DONE] says it is
                    raise aiohttp.ClientPayloadError("the stream ended before [DONE]")
                ok = True
                await resp.write_eof()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                if isinstance(e, ConnectionError) and not isinstance(e, aiohttp.ClientError):
                    ok = True  # the client went away (resp.write): not the worker's fault
                    raise
                self.counters.inc("http_upstream_errors_total")
                self.counters.inc("http_broken_answers_total")
                await self._end_with_error(resp, 502, f"decode worker {url} failed mid-answer: {_describe(e)}")
            finally:
                up.close()
        finally:
            self.core.end(url, ok, n_tokens)

    @staticmethod
    async def _end_with_error(resp: web.StreamResponse, status: int, message: str) -> None:
        await resp.write(sse.event(error_body(status, message)))
        await resp.write(sse.DONE)
        await resp.write_eof()


def make_pd_app(decode_core: RouterCore, prefill_core: RouterCore, pd: PDConfig, **kw) -> web.Application:
    return PDRouterApp(decode_core, prefill_core, pd, **kw).build()
