"""The text a client sees for one request, fed token ids as the engine makes them.

Stop strings are matched on the UTF-8 bytes of the output (a stop string containing
U+FFFD never matches the replacement character of undecodable bytes). The text is cut
before the first stop string found. While streaming, bytes that could still become the
start of a stop string are held back, so no part of a stop string is ever sent; and
bytes are decoded incrementally, so a multi-byte character split over tokens arrives
whole. The concatenation of every piece feed() and finish() return equals the
non-streamed text.
"""

from __future__ import annotations

import bisect
import codecs
from collections.abc import Iterable

from gcache.serving.tokenizer import ByteTokenizer


class OutputText:
    def __init__(self, tokenizer: ByteTokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tok = tokenizer
        self.stops = [s.encode("utf-8") for s in stops]
        self.hold_max = max((len(s) for s in self.stops), default=1) - 1
        self.data = bytearray()  # every output byte so far
        self.token_ends: list[int] = []  # len(data) after each token fed
        self.released = 0  # bytes already handed out as text
        self.stop_at: int | None = None  # byte offset where the first stop string starts
        self.pieces: list[str] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ends)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def kept_tokens(self) -> int:
        """How many of the fed tokens come before the stop string (all of them if none)."""
        if self.stop_at is None:
            return len(self.token_ends)
        return bisect.bisect_right(self.token_ends, self.stop_at)

    def feed(self, ids: Iterable[int]) -> str:
        """Add tokens; returns the text that is now safe to show ("" once stopped)."""
        if self.stop_at is not None:
            return ""
        for i in ids:
            self.data += self.tok.decode_bytes((i,))
            self.token_ends.append(len(self.data))
        found = [p for p in (self.data.find(s, self.released) for s in self.stops) if p >= 0]
        if found:
            self.stop_at = min(found)
            return self._release(self.stop_at, final=True)
        return self._release(len(self.data) - self._held_back(), final=False)

    def finish(self) -> str:
        """The request ended: what was held back is shown (no stop string followed it)."""
        if self.stop_at is not None:
            return ""
        return self._release(len(self.data), final=True)

    def _held_back(self) -> int:
        """Length of the longest tail of the unreleased bytes that starts some stop string."""
        tail = len(self.data) - self.released
        for k in range(min(self.hold_max, tail), 0, -1):
            end = bytes(self.data[-k:])
            if any(s.startswith(end) for s in self.stops):
                return k
        return 0

    def _release(self, upto: int, final: bool) -> str:
        piece = self._decoder.decode(bytes(self.data[self.released : upto]), final=final)
        self.released = upto
        if piece:
            self.pieces.append(piece)
        return piece
