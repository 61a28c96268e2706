"""The router's HTTP front in front of vLLM-like servers (aiohttp stubs that answer as vLLM's
OpenAI server does and say which server they are), in this process: the router's view is
filled as the kv-events translator's registrations would fill it; the model's tokenizer is a
stand-in (the real one and real servers: tests/integrations/vllm/test_vllm_router.py).

  * an unknown model is a 404 (as vLLM answers), counted
  * a body the gcache-worker parser refuses (top_p, tools, parts) goes to vLLM servers
  * a body the model's template cannot render is routed without affinity, not refused
  * the body reaches the server unchanged; a request's first image picks its server
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading

import pytest
from aiohttp import web

from gcache.common.processes import free_port
from gcache.router.config import RouterConfig
from gcache.router.core import RouterCore
from gcache.router.engine_prompts import NotRenderable, first_image
from gcache.router.server import make_app
from gcache.router.state import WorkerView
from gcache.serving.announce.engines import EngineInfo
from gcache.serving.redis_layout import Registration, WorkerLoad
from tests.support.serving_support import post_json, request

pytestmark = pytest.mark.process  # listens on loopback sockets


class StubTokenizer:
    """Renders chat as the code points of its text parts; refuses a message named 'bad'."""

    def tokens(self, chat: bool, payload: dict) -> list[int]:
        if not chat:
            prompt = payload.get("prompt", "")
            return list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]
        out = []
        for m in payload["messages"]:
            if m.get("name") == "bad":
                raise NotRenderable("the template refused it")
            c = m.get("content")
            text = c if isinstance(c, str) else "".join(p.get("text", "") for p in c if isinstance(p, dict))
            out += [ord(ch) for ch in text]
        return out


class Loop:
    """One asyncio loop in a thread running aiohttp apps on loopback ports."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners = []

    def serve(self, app: web.Application) -> int:
        port = free_port()

        async def start():
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        return port

    def close(self) -> None:
        async def stop():
            for r in self.runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def stub_engine(name: str, models: tuple[str, ...]) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw)
        if body.get("model") not in (None, *models):
            return web.json_response({"error": {"message": "The model does not exist.", "code": 404}}, status=404)
        return web.json_response(
            {"server": name, "body_sha": hashlib.sha256(raw).hexdigest(), "choices": [{"message": {"content": "ok"}}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    return app


@pytest.fixture(scope="module")
def fleet():
    loop = Loop()
    ports = [loop.serve(stub_engine(f"e{i}", ("tiny",))) for i in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    core = RouterCore(RouterConfig(workers=tuple(urls), refresh_interval_s=0, tokenizers=(("", "/models/tiny"),)))
    for u in urls:
        reg = Registration(u, "tiny", 16, 1, "e", 0, 0, WorkerLoad())
        core.view.workers[u] = WorkerView(u, reg=reg, info=EngineInfo("vllm", ("tiny",)))
    app = make_app(core, tokenizers={"": StubTokenizer()})
    rport = loop.serve(app)
    yield rport, urls, core
    loop.close()


def metric(port: int, name: str) -> float:
    for line in request(port, "GET", "/metrics")[1].decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_an_unknown_model_is_a_404_and_counted(fleet):
    port, _, _ = fleet
    status, body, _ = post_json(
        port, "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 404 and "gpt-9" in body["error"]["message"]
    assert metric(port, "gcache_router_http_unknown_model_total") >= 1


def test_bodies_only_vllm_accepts_are_routed_unchanged(fleet):
    port, urls, _ = fleet
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "top_p": 0.9,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "logprobs": True,
    }
    raw = json.dumps(body).encode()
    status, out, h = post_json(port, "/v1/chat/completions", raw)
    assert status == 200 and h["x-gcache-worker"] in urls
    assert out["body_sha"] == hashlib.sha256(raw).hexdigest()  # byte for byte
    status, out, _ = post_json(port, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "echo": True})
    assert status == 200
    status, out, _ = post_json(port, "/v1/chat/completions", b"[1, 2]")  # still not a JSON object: 400
    assert status == 400


def test_an_unrenderable_body_is_routed_without_affinity(fleet):
    port, urls, _ = fleet
    before = metric(port, "gcache_router_http_untokenized_total")
    msgs = [{"role": "user", "name": "bad", "content": "x"}]
    status, _, h = post_json(port, "/v1/chat/completions", {"model": "tiny", "messages": msgs})
    assert status == 200 and h["x-gcache-worker"] in urls
    assert metric(port, "gcache_router_http_untokenized_total") == before + 1


def image_chat(img: bytes, text: str) -> dict:
    url = "data:image/png;base64," + base64.b64encode(img).decode()
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}]}


def test_a_requests_first_image_picks_its_server(fleet):
    port, urls, core = fleet
    homes = {}
    for i in range(12):
        img = bytes([i, 7, 7]) * 50
        seen = {
            post_json(port, "/v1/chat/completions", image_chat(img, t))[2]["x-gcache-worker"]
            for t in ("a", "bb", "ccc")
        }
        assert len(seen) == 1  # the same image, whatever the text, goes to one server
        homes[i] = seen.pop()
    assert len(set(homes.values())) >= 2  # different images spread
    assert first_image(image_chat(b"abc", "x")) == hashlib.sha256(b"abc").digest()
    assert first_image({"messages": [{"role": "user", "content": "no image"}]}) is None
