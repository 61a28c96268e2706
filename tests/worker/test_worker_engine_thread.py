"""EngineThread in process: step hooks, stop strings ending a request early, cancellation.

A real engine (tiny float64 model) in its own thread; the test plays the HTTP handler's
part on an asyncio loop, as http_server does.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from gcache.serving.stop_text import OutputText
from gcache.serving.tokenizer import ByteTokenizer
from gcache.worker.engine.engine_thread import EngineThread, Pending
from gcache.worker.engine.messages import Accepted, Finished, Rejected, TextPiece
from gcache.worker.engine.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from gcache.worker.engine.scheduler import EngineStoppedError
from gcache.worker.http.flags import build_engine, parse_args
from tests.support.engine_support import InEngine
from tests.support.serving_support import WORKER_ARGS

WAIT_S = 30.0
PROMPT = list(b"The engine thread reports to the asyncio loop. ")


@pytest.fixture
def engine_thread():
    engine, _ = build_engine(parse_args(WORKER_ARGS))
    et = EngineThread(engine, inbox_max=8, integrity_check_s=0)
    et.in_engine = InEngine()
    et.add_step_hook(et.in_engine)
    yield et
    et.stopping.set()
    if et.is_alive():
        et.join(10)
    engine.close()


KINDS = {Accepted: "accepted", TextPiece: "text", Finished: "done", Rejected: "error"}


async def run_one(et: EngineThread, prompt, max_tokens: int, stops=(), stream=False, on_text=None):
    """Submit one request; return (events seen, request, output text)."""
    tok = ByteTokenizer(et.engine.vocab_size)
    p = Pending(
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        OutputText(tok, stops),
        stream,
        asyncio.get_running_loop(),
    )
    et.submit(p)
    seen = []
    while True:
        msg = await asyncio.wait_for(p.events.get(), WAIT_S)
        seen.append(KINDS[type(msg)])
        if isinstance(msg, TextPiece) and on_text is not None:
            on_text(p)
            on_text = None
        if isinstance(msg, Finished):
            return seen, msg.request, p.output
        if isinstance(msg, Rejected):
            raise msg.error


def test_step_hooks_run_idle_and_after_steps_and_a_failing_hook_is_not_fatal(engine_thread):
    calls = []
    idle_seen = threading.Event()

    def counting(engine):
        calls.append(engine.has_work())
        if len(calls) >= 3:
            idle_seen.set()

    def failing(engine):
        raise RuntimeError("hook bug")

    engine_thread.add_step_hook(failing)
    engine_thread.add_step_hook(counting)
    engine_thread.start()
    assert idle_seen.wait(WAIT_S), "hooks did not run while the engine was idle"
    before = len(calls)
    seen, r, out = asyncio.run(run_one(engine_thread, PROMPT, 6))
    assert r.finish_reason == FINISH_LENGTH and len(r.output) == 6 and out.num_tokens == 6
    assert seen == ["accepted", "done"]  # not streamed: no text events
    assert True in calls[before:], "no hook call saw the engine with work (after a step)"
    assert engine_thread.hook_errors >= len(calls) - 1 and engine_thread.is_serving()


def test_stop_string_ends_the_request_on_the_step_that_produced_it(engine_thread):
    engine_thread.start()
    _, full, full_out = asyncio.run(run_one(engine_thread, PROMPT, 40))
    data = bytes(full_out.data)
    # A 2-byte ASCII stop string whose first occurrence is at i >= 2.
    i = next(
        i
        for i in range(2, len(data) - 1)
        if all(32 <= b < 127 for b in data[i : i + 2]) and data.find(data[i : i + 2]) == i
    )
    stop = data[i : i + 2].decode()
    seen, r, out = asyncio.run(run_one(engine_thread, PROMPT, 40, stops=(stop, "never-there"), stream=True))
    assert r.finish_reason == FINISH_STOP and out.stopped
    assert list(r.output) == list(full.output[: i + 2])  # one token per byte: stopped right at the stop
    assert out.text == data[:i].decode("utf-8", errors="replace") and out.kept_tokens() == i
    assert seen[0] == "accepted" and seen[-1] == "done" and "text" in seen
    engine_thread.in_engine.run(lambda e: e.check_integrity())
    # The cached prefix stays usable: the same request again hits the cache and gives the same text.
    _, again, again_out = asyncio.run(run_one(engine_thread, PROMPT, 40, stops=(stop,)))
    assert again_out.text == out.text and again.cached_tokens > 0


def test_cancel_stops_computing_and_frees_the_pages(engine_thread):
    gate = threading.Event()  # the engine waits after its first token until the test has cancelled

    def hold(engine):
        if not gate.is_set() and any(r.output for r in engine.batcher.running):
            gate.wait(WAIT_S)

    def cancel(p):
        engine_thread.cancel(p)
        gate.set()

    engine_thread.add_step_hook(hold)
    engine_thread.start()
    seen, r, out = asyncio.run(run_one(engine_thread, PROMPT, 60, stream=True, on_text=cancel))
    assert r.finish_reason == FINISH_ABORT and len(r.output) == 1 and seen[-1] == "done"

    def state(e):
        e.check_integrity()
        return len(e.batcher.running), len(e.scheduler.waiting), e.kv.full.num_used, e.cache.cached_pages()[0]

    running, waiting, used, tree_full = engine_thread.in_engine.run(state)
    assert running == waiting == 0
    assert used == tree_full  # nothing left owned by the cancelled request


def test_a_handler_asks_the_engine_thread_what_is_in_l3_and_never_reads_the_cache_itself(engine_thread):
    """PD prefill's wait: the question rides the inbox and the cache answers on the engine
    thread (the only reader of cache entries); a stopped engine refuses the question."""
    et = engine_thread
    asked_on: list[str] = []

    def stored_in_l3(keys, swa_lo):
        asked_on.append(threading.current_thread().name)
        return len(keys) - swa_lo, True

    et.engine.cache.stored_in_l3 = stored_in_l3
    et.start()

    async def ask():
        return await et.ask_stored_in_l3(["a", "b", "c"], 1, WAIT_S)

    got = asyncio.run(ask())
    assert (got.pages, got.queued) == (2, True) and asked_on == [et.name]
    et.stopping.set()
    et.join(10)
    with pytest.raises(EngineStoppedError):
        asyncio.run(ask())
