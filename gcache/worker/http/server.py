"""`gcache-worker`: the OpenAI API over HTTP (aiohttp) in front of one Engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with stream=true as
server-sent events), GET /health, GET /metrics (Prometheus), GET /v1/models.
With --l3, /health also says whether the store answers ("l3": up / unreachable, when it
last answered): the worker serves either way, without L3 while it is unreachable.

A request's way through: its body is read under --body-timeout-s and the 8 MiB limit
(no slot held meanwhile: a stalled client cannot starve the others), parsed (400 for
anything malformed), then it takes one of --max-in-flight slots (503 when none is free)
and goes to the engine thread (engine_thread.py), which reports back on this loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from aiohttp import web

from gcache.common.host_checks import gauges as host_gauges
from gcache.common.host_checks import run_checks, warning_lines
from gcache.errors import GCacheError
from gcache.serving import runner, sse
from gcache.serving.body import BODY_BYTES_MAX, BODY_DEADLINE_S
from gcache.serving.counters import HTTPCounters, prometheus_response
from gcache.serving.errors import error_body, error_response, json_response
from gcache.serving.handoff import Role
from gcache.serving.intake import openai_app, serve_post
from gcache.serving.limiter import InFlightLimiter
from gcache.serving.openai_api import CHAT_PATH, COMPLETIONS_PATH, ParsedRequest, parse_request
from gcache.serving.openai_bodies import StreamChunks, response_id
from gcache.serving.stop_text import OutputText
from gcache.serving.tokenizer import ByteTokenizer
from gcache.worker.engine.engine import Engine
from gcache.worker.engine.engine_thread import EngineThread, Pending
from gcache.worker.engine.messages import Accepted, EngineMessage, Finished, Rejected, TextPiece
from gcache.worker.engine.request import FINISH_ABORT
from gcache.worker.engine.scheduler import EngineStoppedError, QueueFullError
from gcache.worker.http import completions
from gcache.worker.http.flags import build_engine, parse_args
from gcache.worker.http.pd_flags import HANDOFF_WAIT_S
from gcache.worker.http.pd_routes import PDRoutes
from gcache.worker.http.publisher import start_publisher

__all__ = ["EngineThread", "WorkerApp", "make_app", "main", "parse_args", "build_engine"]

log = logging.getLogger("gcache.worker")
LIVENESS_CHECK_S = 1.0  # a handler waiting on the engine checks this often that the engine still runs
HTTP_COUNTERS = {
    "http_rejected_in_flight_total": "requests answered 503 because every --max-in-flight slot was taken",
    "http_body_timeouts_total": "requests whose body did not arrive within --body-timeout-s (408)",
    "http_client_gone_total": "streamed requests cancelled because the client went away",
    "http_request_timeouts_total": "requests not finished within --request-timeout-s (504 or stream error)",
}


class WorkerApp:
    """The aiohttp handlers of one worker; the engine lives in `engine_thread`."""

    def __init__(
        self,
        engine_thread: EngineThread,
        model_name: str,
        request_timeout_s: float = 600.0,
        max_in_flight: int = 256,
        body_timeout_s: float = BODY_DEADLINE_S,
        body_bytes_max: int = BODY_BYTES_MAX,
    ) -> None:
        self.engine_thread = engine_thread
        self.tok = ByteTokenizer(engine_thread.engine.vocab_size)
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.body_timeout_s, self.body_bytes_max = body_timeout_s, body_bytes_max
        self.limiter = InFlightLimiter(max_in_flight)
        self.counters = HTTPCounters(
            "gcache_worker_", (COMPLETIONS_PATH, CHAT_PATH, "/health", "/metrics", "/v1/models"), HTTP_COUNTERS
        )
        self.host_gauges: dict[str, int] = {}  # host_check_<name>: 1 ok, 0 warn, -1 unknown

    def build(self) -> web.Application:
        app = openai_app(
            self.counters, log, self.body_bytes_max, self.completions, self.chat, self.health, self.metrics
        )
        app.router.add_get("/v1/models", self.models)
        return app

    # ---- GET ------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        ok = self.engine_thread.is_serving()
        snap = self.engine_thread.engine.metrics.snapshot()
        body = {
            "status": "ok" if ok else "down",
            "waiting": snap["waiting_requests"],
            "running": snap["running_requests"],
            "in_flight": self.limiter.in_flight,
        }
        l3 = self.engine_thread.engine.cache.l3_health()
        if l3 is not None:  # L3 is optional: an unreachable store does not make the worker unhealthy
            body["l3"] = l3
        return json_response(200 if ok else 503, body)

    async def metrics(self, request: web.Request) -> web.Response:
        et = self.engine_thread
        text = et.engine.metrics.render() + self.counters.render(
            {
                "http_in_flight": ("requests holding a completion slot", self.limiter.in_flight),
                "step_hook_errors": ("exceptions raised by engine step hooks (logged, not fatal)", et.hook_errors),
                **{
                    name: ("host check at start: 1 ok, 0 warning (logged with its fix), -1 unreadable", value)
                    for name, value in self.host_gauges.items()
                },
            }
        )
        return prometheus_response(text)

    async def models(self, request: web.Request) -> web.Response:
        return json_response(
            200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "gcache"}]}
        )

    # ---- POST -----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS_PATH)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT_PATH)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        async def run(body: bytes, parsed: ParsedRequest) -> web.StreamResponse:
            return await self._run(request, parsed)

        return await serve_post(
            request,
            lambda payload: parse_request(path, payload, self.tok),
            run,
            limiter=self.limiter,
            counters=self.counters,
            body_bytes_max=self.body_bytes_max,
            body_timeout_s=self.body_timeout_s,
        )

    async def _run(self, request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
        p = Pending(
            parsed.prompt,
            completions.sampling_params(parsed, self.tok),
            OutputText(self.tok, parsed.stop),
            parsed.stream,
            asyncio.get_running_loop(),
        )
        return await self.run_pending(request, parsed, p)

    async def run_pending(
        self, request: web.Request, parsed: ParsedRequest, p: Pending, chunks: StreamChunks | None = None
    ) -> web.StreamResponse:
        """Submit p and answer with it: a stream (chunks: its ids; a chat stream's role chunk
        only when chunks is None) or one body. PD decode passes its own chunks (pd_routes)."""
        loop = asyncio.get_running_loop()
        try:
            self.engine_thread.submit(p)
        except QueueFullError as e:
            return error_response(503, f"server busy: {e}")
        deadline = loop.time() + self.request_timeout_s
        try:
            msg = await self._next_event(p, deadline)
            if isinstance(msg, Accepted) and parsed.stream:
                return await self._stream(request, parsed, p, deadline, chunks)
            while isinstance(msg, Accepted):  # not streamed: no TextPiece, only Finished (or Rejected)
                msg = await self._next_event(p, deadline)
            if isinstance(msg, Rejected):
                status = 503 if isinstance(msg.error, QueueFullError) else 400
                return error_response(status, str(msg.error))
            if not isinstance(msg, Finished):  # cannot happen: TextPiece is posted to streams only
                raise RuntimeError(f"invariant broken: {msg!r} for a request that does not stream")
            return self._full_answer(parsed, p, msg.request, None if chunks is None else chunks.id)
        except asyncio.TimeoutError:
            self.engine_thread.cancel(p)
            self.counters.inc("http_request_timeouts_total")
            return error_response(504, f"request did not finish within {self.request_timeout_s:g} s")
        except asyncio.CancelledError:
            self.engine_thread.cancel(p)
            raise

    def _full_answer(self, parsed: ParsedRequest, p: Pending, r, rid: str | None = None) -> web.Response:
        if r.finish_reason == FINISH_ABORT and not p.output.stopped:
            return error_response(503, f"request aborted: {r.error}")
        body = completions.full_response(parsed.kind, r, p.output, self.model_name)
        if rid is not None:
            body["id"] = rid
        return json_response(200, body)

    async def _next_event(self, p: Pending, deadline: float) -> EngineMessage:
        """The engine thread's next message for p; TimeoutError at the deadline. While waiting,
        check every LIVENESS_CHECK_S that the engine thread still runs (a crash is a 503)."""
        loop = asyncio.get_running_loop()
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                return await asyncio.wait_for(p.events.get(), min(left, LIVENESS_CHECK_S))
            except asyncio.TimeoutError:
                if not self.engine_thread.is_serving() and p.events.empty():
                    return Rejected(EngineStoppedError("engine stopped"))

    async def _stream(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        p: Pending,
        deadline: float,
        chunks: StreamChunks | None = None,
    ) -> web.StreamResponse:
        continues = chunks is not None  # PD decode: the router sent the role and first token
        if chunks is None:
            if p.request is None:  # cannot happen: ACCEPTED: the engine thread set it
                raise RuntimeError("invariant broken: ACCEPTED: the engine thread set it")
            chunks = StreamChunks(parsed.kind, response_id(parsed.kind, p.request.rid), self.model_name)
        resp = await sse.start(request)
        try:
            role = None if continues else chunks.role()
            if role is not None:
                await resp.write(sse.event(role))
            while True:
                try:
                    msg = await self._next_event(p, deadline)
                except asyncio.TimeoutError:
                    self.engine_thread.cancel(p)
                    self.counters.inc("http_request_timeouts_total")
                    await resp.write(
                        sse.event(error_body(504, f"request did not finish within {self.request_timeout_s:g} s"))
                    )
                    break
                if isinstance(msg, TextPiece):
                    await resp.write(sse.event(chunks.text(msg.text)))
                    continue
                if isinstance(msg, Rejected):
                    await resp.write(sse.event(error_body(503, str(msg.error))))
                    break
                if not isinstance(msg, Finished):  # cannot happen: Accepted comes once, first
                    raise RuntimeError(f"invariant broken: {msg!r} after Accepted")
                r = msg.request
                if r.finish_reason == FINISH_ABORT and not p.output.stopped:
                    await resp.write(sse.event(error_body(503, f"request aborted: {r.error}")))
                    break
                await resp.write(sse.event(chunks.text("", completions.finish_reason(r, p.output))))
                if parsed.include_usage:
                    await resp.write(sse.event(chunks.usage(completions.usage(r))))
                break
            await resp.write(sse.DONE)
            await resp.write_eof()
        except ConnectionError:  # the client went away: stop computing for it
            self.engine_thread.cancel(p)
            self.counters.inc("http_client_gone_total")
        return resp


def make_app(
    engine: Engine,
    model_name: str,
    request_timeout_s: float = 600.0,
    max_in_flight: int = 256,
    integrity_check_s: float = 5.0,
    body_timeout_s: float = BODY_DEADLINE_S,
    body_bytes_max: int = BODY_BYTES_MAX,
    role: Role = Role.MIXED,
    handoff_wait_s: float = HANDOFF_WAIT_S,
    host_gauges: dict[str, int] | None = None,
) -> tuple[web.Application, EngineThread]:
    """The aiohttp app and its (not yet started) engine thread; host_gauges: the host checks'
    results for /metrics (gcache.common.host_checks.gauges)."""
    engine_thread = EngineThread(engine, inbox_max=max(1, max_in_flight), integrity_check_s=integrity_check_s)
    worker = WorkerApp(engine_thread, model_name, request_timeout_s, max_in_flight, body_timeout_s, body_bytes_max)
    worker.host_gauges = dict(host_gauges or {})
    app = worker.build()
    PDRoutes(worker, Role(role), handoff_wait_s).install(app)  # /pd/prefill, /pd/decode by role
    return app, engine_thread


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host = run_checks()  # no arena or connection caps of its own: the host-wide settings
    for line in warning_lines(host):
        log.warning("%s", line)
    try:
        engine, name = build_engine(args)
    except (ValueError, OSError, GCacheError) as e:
        print(f"gcache-worker: {e}", file=sys.stderr)
        return 2
    app, engine_thread = make_app(
        engine,
        name,
        args.request_timeout_s,
        args.max_in_flight,
        args.integrity_check_s,
        args.body_timeout_s,
        role=Role(args.role),
        handoff_wait_s=args.pd_handoff_wait_s,
        host_gauges=host_gauges(host),
    )
    engine.cache.start()  # an unreachable L3 store is logged now (and again when it answers)
    engine_thread.start()
    publisher = None

    def started(port: int) -> None:
        nonlocal publisher
        publisher = start_publisher(args, engine_thread, bound_port=port)  # None without --redis
        tiers = "L1"
        l2_bytes, health = engine.cache.l2_bytes(), engine.cache.l3_health()
        if l2_bytes:
            tiers += f" + L2 ({l2_bytes >> 20} MiB)"
        if health is not None:
            state = "up" if health["state"] == "up" else "UNREACHABLE at start: serving without it until it answers"
            tiers += f" + L3 ({args.l3}, {state})"
        print(
            f"gcache-worker: serving {name} on http://{args.host}:{port} (full pages {engine.kv.full.num_pages}, "
            f"swa pages {engine.kv.swa.num_pages}; cache {tiers}; role {args.role})",
            flush=True,
        )

    async def stopping() -> None:  # abort what runs so every handler answers, then the server closes
        engine_thread.stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, engine_thread.join, 10)

    try:
        runner.serve_forever(app, args.host, args.port, on_started=started, before_cleanup=stopping)
    except OSError as e:
        print(f"gcache-worker: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad publisher flags
        print(f"gcache-worker: {e}", file=sys.stderr)
        return 2
    finally:
        if publisher is not None:
            publisher.stop()
        engine_thread.stopping.set()
        engine_thread.join(timeout=10)
        engine.close()
    if engine_thread.failure is not None:
        print(f"gcache-worker: engine failed: {engine_thread.failure!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
