"""What the engine thread tells a handler about its Pending (engine_thread.py): one small,
typed message each, posted on the handler's loop (Pending.events).

  Accepted        the engine took the request (or Rejected: bad input, queue full,
                  EngineStoppedError);
  TextPiece       streamed requests only: new text that is safe to show;
  Finished        finished (or cancelled); pending.output holds the final text. Exactly one
                  per accepted request.

And what a handler asks of the engine thread, the only reader of cache entries (one small,
typed question each, answered on the asker's loop):

  StoredInL3      the PD prefill's wait: how much of a prompt's KV is in L3 (L3Stored).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import NamedTuple

from gcache.worker.engine.request import Request


@dataclass(frozen=True)
class Accepted:
    """The engine took the request (Pending.request is set)."""


@dataclass(frozen=True)
class TextPiece:
    """New text of a streamed request that is safe to show."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The request finished or was cancelled (its finish_reason says which)."""

    request: Request


@dataclass(frozen=True)
class Rejected:
    """The request was not taken: ValueError (bad input), QueueFullError or EngineStoppedError."""

    error: Exception


EngineMessage = Accepted | TextPiece | Finished | Rejected


class L3Stored(NamedTuple):
    """The answer to StoredInL3 (CacheManager.stored_in_l3)."""

    pages: int  # leading pages whose KV is in L3 (full; SWA from swa_lo on)
    queued: bool  # whether any page is still queued for L3


@dataclass(frozen=True)
class StoredInL3:
    """How many leading pages of `keys` have their KV in L3 (full, and SWA from swa_lo on),
    and whether any is still queued for it: answered by the engine thread on `answer`."""

    keys: tuple[str, ...]
    swa_lo: int
    answer: asyncio.Future[L3Stored]


def resolve(answer: asyncio.Future[L3Stored], value: L3Stored) -> None:
    """On the asker's loop: set the answer unless the asker gave up (timeout, cancel)."""
    if not answer.done():
        answer.set_result(value)
