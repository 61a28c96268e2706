"""The engine's own thread, and how HTTP handlers on an asyncio loop talk to it.

Only this thread touches the engine. A handler builds a Pending and submit()s it (a
bounded inbox); the thread adds it to the engine and reports back through the handler's
loop (loop.call_soon_threadsafe, so nothing polls), one typed message each (messages.py):
    Accepted()           the engine took it (or Rejected(error): bad input, queue full,
                         EngineStoppedError);
    TextPiece(text)      streamed requests only: new text that is safe to show;
    Finished(request)    finished (or cancelled); pending.output holds the final text.
A handler's question (messages.StoredInL3) travels through the same inbox, is answered
between steps and comes back on its future: cache entries are read on this thread only.
Stop strings are checked here after every step, so a request stops on the step that
produced its stop string. Step hooks (fn(engine)) run after every step and at least
every IDLE_WAIT_S while idle; a hook that raises is logged and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from gcache.serving.stop_text import OutputText
from gcache.worker.engine.engine import Engine
from gcache.worker.engine.messages import (
    Accepted,
    EngineMessage,
    Finished,
    L3Stored,
    Rejected,
    StoredInL3,
    TextPiece,
    resolve,
)
from gcache.worker.engine.request import FINISH_ABORT, FINISH_STOP, Request, SamplingParams
from gcache.worker.engine.scheduler import EngineStoppedError, QueueFullError

log = logging.getLogger("gcache.worker")

IDLE_WAIT_S = 0.1  # idle: wake this often for hooks and the integrity check
HOOK_LOG_EVERY = 1000  # after the first error of a hook, log every N-th


class Pending:
    """One submission travelling from a handler to the engine thread and back."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        output: OutputText,
        stream: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.prompt, self.params, self.output, self.stream = prompt, params, output, stream
        self.loop = loop
        self.events: asyncio.Queue[EngineMessage] = asyncio.Queue()  # bounded by max_tokens + 2 messages
        self.request: Request | None = None
        self.fed = 0  # output tokens already given to self.output
        self.cancelled = False  # set by the handler (client gone, timeout)
        self.handed: tuple[int, ...] = ()  # PD decode: output tokens the prefill worker sampled

    def post(self, message: EngineMessage) -> None:
        """From the engine thread: hand a message to the handler's loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, message)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening
            pass


class EngineThread(threading.Thread):
    """Owns the engine: drains the inbox, steps while there is work, reports to the handlers."""

    def __init__(self, engine: Engine, inbox_max: int, integrity_check_s: float = 5.0) -> None:
        super().__init__(name="engine-loop", daemon=True)
        self.engine = engine
        self.integrity_check_s = integrity_check_s
        self._last_check = time.monotonic()
        self.inbox: queue.Queue[Pending | StoredInL3] = queue.Queue(maxsize=max(1, inbox_max))
        self.cancels: collections.deque[Pending] = collections.deque()  # one entry per in-flight request at most
        self.waiters: dict[int, Pending] = {}
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self._hooks: list[Callable[[Engine], None]] = []
        self.hook_errors = 0

    # ---- called from other threads ------------------------------------------------------------
    def submit(self, p: Pending) -> None:
        if self.stopping.is_set() or not self.is_alive():
            raise EngineStoppedError("engine is not running")
        try:
            self.inbox.put_nowait(p)
        except queue.Full:
            raise QueueFullError("inbox is full") from None

    async def ask_stored_in_l3(self, keys: Sequence[str], swa_lo: int, timeout_s: float) -> L3Stored:
        """From a handler's loop: how much of keys' KV is in L3 (CacheManager.stored_in_l3),
        answered by this thread between steps. Bounded: QueueFullError when the inbox is full,
        asyncio.TimeoutError after timeout_s, EngineStoppedError when the engine is not running."""
        if self.stopping.is_set() or not self.is_alive():
            raise EngineStoppedError("engine is not running")
        question = StoredInL3(tuple(keys), swa_lo, asyncio.get_running_loop().create_future())
        try:
            self.inbox.put_nowait(question)
        except queue.Full:
            raise QueueFullError("inbox is full") from None
        return await asyncio.wait_for(question.answer, timeout_s)

    def cancel(self, p: Pending) -> None:
        """The handler gave up on p (client gone, timeout): stop computing it."""
        p.cancelled = True
        self.cancels.append(p)

    def add_step_hook(self, fn: Callable[[Engine], None]) -> None:
        """fn(engine) runs in this thread after every step and at least every IDLE_WAIT_S idle."""
        self._hooks.append(fn)

    def is_serving(self) -> bool:
        return self.is_alive() and not self.stopping.is_set()

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._drain_inbox(block=not self.engine.has_work())
                self._apply_cancels()
                if self.engine.has_work():
                    finished = self.engine.step()
                    self._report(finished)
                    self._run_hooks()
                    if not self.engine.last_step_ran:
                        time.sleep(0.001)  # waiting requests wait on L3 prefetches
                else:
                    self._run_hooks()
                    if self.integrity_check_s and time.monotonic() - self._last_check >= self.integrity_check_s:
                        self.engine.check_integrity()  # idle: an IntegrityError stops the worker loudly
                        self._last_check = time.monotonic()
        except BaseException as e:  # crash loudly, but never leave a waiter hanging
            self.failure = e
            raise
        finally:
            self.stopping.set()
            for r in self.engine.abort_all():
                self._done(r)
            self._drain_inbox(block=False)

    def _drain_inbox(self, block: bool) -> None:
        for i in range(self.inbox.maxsize):
            try:
                p = self.inbox.get(timeout=IDLE_WAIT_S) if block and i == 0 else self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(p, StoredInL3):
                self._answer(p)
                continue
            if p.cancelled:
                continue
            if self.stopping.is_set():
                p.post(Rejected(EngineStoppedError("engine is stopping")))
                continue
            try:
                p.request = self.engine.add_request(p.prompt, p.params, handed=p.handed)
            except (ValueError, QueueFullError) as e:
                p.post(Rejected(e))
                continue
            self.waiters[p.request.rid] = p
            p.post(Accepted())

    def _answer(self, q: StoredInL3) -> None:
        value = L3Stored(*self.engine.cache.stored_in_l3(q.keys, q.swa_lo))
        try:
            q.answer.get_loop().call_soon_threadsafe(resolve, q.answer, value)
        except RuntimeError:  # the loop is closed (shutdown): nobody is asking any more
            pass

    def _apply_cancels(self) -> None:
        while self.cancels:
            p = self.cancels.popleft()
            r = p.request
            if r is not None and self.waiters.pop(r.rid, None) is not None:
                self.engine.finish_early(r, FINISH_ABORT)
                p.post(Finished(r))  # every accepted request gets exactly one Finished

    def _report(self, finished: list[Request]) -> None:
        """Feed new tokens to each request's output text; end requests whose stop string appeared."""
        for r in list(self.engine.batcher.running):
            p = self.waiters.get(r.rid)
            if p is None or len(r.output) == p.fed:
                continue
            self._feed(p, r)
            if p.output.stopped and self.engine.finish_early(r, FINISH_STOP):
                finished.append(r)
        for r in finished:
            self._done(r)

    def _feed(self, p: Pending, r: Request) -> None:
        piece = p.output.feed(r.output[p.fed :])
        p.fed = len(r.output)
        if piece and p.stream:
            p.post(TextPiece(piece))

    def _done(self, r: Request) -> None:
        p = self.waiters.pop(r.rid, None)
        if p is None:
            return
        if len(r.output) > p.fed:
            self._feed(p, r)
        piece = p.output.finish()
        if piece and p.stream:
            p.post(TextPiece(piece))
        p.post(Finished(r))

    def _run_hooks(self) -> None:
        for fn in self._hooks:
            try:
                fn(self.engine)
            except Exception:
                self.hook_errors += 1
                if self.hook_errors == 1 or self.hook_errors % HOOK_LOG_EVERY == 0:
                    log.exception("step hook %r failed (%d failures so far)", fn, self.hook_errors)
