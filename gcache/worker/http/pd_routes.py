"""The worker's PD endpoints (gcache/serving/handoff.py has the contract).

POST /pd/prefill (roles prefill, mixed): {"path", "request"} -> runs the prompt to its first
token, waits (bounded) until the prompt's KV is in L3, answers
    {"done": false, "events": [SSE chunks up to the first token], "handoff": {...}}
or, when the first token already ends the request (max_tokens 1, a stop token or string),
    {"done": true, "events": [...the whole stream...]} / {"done": true, "body": {...}}.
POST /pd/decode (roles decode, mixed): {"path", "request", "handoff"} -> the rest of the
answer as /v1/* would give it (a stream without the role chunk, which the router sent;
every id = handoff.response_id). The decode worker's engine admits it like any request whose
prefix is in L3: a prefetch into host slots while it waits, device pages at admission.
"""

from __future__ import annotations

import asyncio
import dataclasses

from aiohttp import web

from gcache.common.attention import AttentionKind
from gcache.serving.errors import HTTPError, error_response, json_response
from gcache.serving.handoff import PD_DECODE_PATH, PD_PREFILL_PATH, Handoff, Role, expected_pools, parse_pd_body
from gcache.serving.intake import serve_post
from gcache.serving.openai_api import ParsedRequest, parse_request
from gcache.serving.openai_bodies import StreamChunks, response_id
from gcache.serving.stop_text import OutputText
from gcache.wire.keys import page_hashes_array
from gcache.worker.engine.engine_thread import Pending
from gcache.worker.engine.messages import Accepted, Finished, Rejected
from gcache.worker.engine.request import FINISH_ABORT, FINISH_STOP
from gcache.worker.engine.scheduler import QueueFullError
from gcache.worker.http import completions
from gcache.worker.http.pd_prefill import wait_stored

L3_DOWN_HEADER = "x-gcache-pd"  # value "l3-down": the router serves the request mixed instead


class PDRoutes:
    def __init__(self, worker, role: Role, handoff_wait_s: float) -> None:
        self.w, self.role, self.handoff_wait_s = worker, role, handoff_wait_s
        engine = worker.engine_thread.engine
        self.engine = engine
        self.ps, self.window = engine.page_size, engine.window

    def install(self, app: web.Application) -> None:
        if self.role.serves_prefill():
            app.router.add_post(PD_PREFILL_PATH, self.prefill)
        if self.role.serves_decode():
            app.router.add_post(PD_DECODE_PATH, self.decode)

    def _serve(self, request: web.Request, need_handoff: bool, run):
        def parse(payload):
            path, body, handoff = parse_pd_body(payload, need_handoff)
            return parse_request(path, body, self.w.tok), handoff

        async def handle(_body: bytes, parsed):
            return await run(request, *parsed)

        w = self.w
        return serve_post(
            request,
            parse,
            handle,
            limiter=w.limiter,
            counters=w.counters,
            body_bytes_max=w.body_bytes_max,
            body_timeout_s=w.body_timeout_s,
        )

    # ---- prefill -------------------------------------------------------------------------------
    async def prefill(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, False, self._prefill)

    async def _prefill(self, request: web.Request, parsed: ParsedRequest, _h) -> web.StreamResponse:
        if not self.engine.cache.l3_available():
            return error_response(503, "L3 is unavailable: no handoff possible", headers={L3_DOWN_HEADER: "l3-down"})
        w, loop = self.w, asyncio.get_running_loop()
        params = dataclasses.replace(completions.sampling_params(parsed, w.tok), max_tokens=1)
        p = Pending(parsed.prompt, params, OutputText(w.tok, parsed.stop), False, loop)
        try:
            w.engine_thread.submit(p)
        except QueueFullError as e:
            return error_response(503, f"server busy: {e}")
        deadline = loop.time() + w.request_timeout_s
        try:
            msg = await w._next_event(p, deadline)
            while isinstance(msg, Accepted):
                msg = await w._next_event(p, deadline)
        except asyncio.TimeoutError:
            w.engine_thread.cancel(p)
            return error_response(504, f"prefill did not finish within {w.request_timeout_s:g} s")
        except asyncio.CancelledError:
            w.engine_thread.cancel(p)
            raise
        if isinstance(msg, Rejected):
            return error_response(503 if isinstance(msg.error, QueueFullError) else 400, str(msg.error))
        if not isinstance(msg, Finished):  # cannot happen: the prefill does not stream
            raise RuntimeError(f"invariant broken: {msg!r} for the prefill of a handoff")
        r = msg.request
        if r.finish_reason == FINISH_ABORT and not p.output.stopped:
            return error_response(503, f"request aborted: {r.error}")
        first = r.output[0]
        chunks = StreamChunks(parsed.kind, response_id(parsed.kind, r.rid), w.model_name)
        opening = [c for c in (chunks.role(),) if c is not None]
        if parsed.max_tokens <= 1 or r.finish_reason == FINISH_STOP or p.output.stopped:
            return json_response(200, self._done(parsed, r, p, chunks, opening))
        # What a mixed worker would have streamed after this token (held-back stop-string
        # prefixes stay held: the decode worker feeds the same token and shows them later).
        piece = OutputText(w.tok, parsed.stop).feed([first])
        keys = page_hashes_array(parsed.prompt, self.ps)
        pools = expected_pools(len(parsed.prompt), self.ps, self.window)
        stored = await wait_stored(
            w.engine_thread.ask_stored_in_l3, keys, pools[AttentionKind.SWA][0], self.handoff_wait_s
        )
        handoff = Handoff(
            model=w.model_name,
            page_size=self.ps,
            window=self.window,
            prompt_tokens=len(parsed.prompt),
            first_token=int(first),
            sampled=1,
            pages=tuple(keys),
            pools=pools,
            stored_pages=stored,
            response_id=chunks.id,
            created=chunks.created,
        )
        events = opening + ([chunks.text(piece)] if piece else [])
        return json_response(
            200, {"done": False, "events": events, "handoff": handoff.to_dict(), "usage": completions.usage(r)}
        )

    def _done(self, parsed: ParsedRequest, r, p: Pending, chunks: StreamChunks, opening: list) -> dict:
        """The whole answer, when the first token ended it."""
        if not parsed.stream:
            return {"done": True, "body": completions.full_response(parsed.kind, r, p.output, self.w.model_name)}
        events = list(opening)
        if p.output.text:
            events.append(chunks.text(p.output.text))
        events.append(chunks.text("", completions.finish_reason(r, p.output)))
        if parsed.include_usage:
            events.append(chunks.usage(completions.usage(r)))
        return {"done": True, "events": events}

    # ---- decode --------------------------------------------------------------------------------
    async def decode(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, True, self._decode)

    async def _decode(self, request: web.Request, parsed: ParsedRequest, h: Handoff) -> web.StreamResponse:
        w = self.w
        try:
            h.validate(w.model_name, self.ps, self.window, parsed.prompt, self.engine.vocab_size)
            params = completions.sampling_params(parsed, w.tok)
            if parsed.max_tokens <= 1 or h.first_token in params.stop_token_ids:
                raise HTTPError(400, "handoff: the first token already ended this request")
        except HTTPError as e:
            return error_response(e.status, e.message)
        out = OutputText(w.tok, parsed.stop)
        out.feed([h.first_token])  # shown by the prefill side: the text goes on from here
        if out.stopped:
            return error_response(400, "handoff: the first token already ended this request")
        p = Pending(parsed.prompt, params, out, parsed.stream, asyncio.get_running_loop())
        p.handed, p.fed = (h.first_token,), 1
        chunks = StreamChunks(parsed.kind, h.response_id, w.model_name)
        chunks.created = h.created
        return await w.run_pending(request, parsed, p, chunks)
