"""What the engine thread tells a handler about its Pending (engine_thread.py): one small,
typed message each, posted on the handler's loop (Pending.events).

  Accepted        the engine took the request (or Rejected: bad input, queue full,
                  EngineStoppedError);
  TextPiece       streamed requests only: new text that is safe to show;
  Finished        finished (or cancelled); pending.output holds the final text. Exactly one
                  per accepted request.
"""

from __future__ import annotations

from dataclasses import dataclass

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
