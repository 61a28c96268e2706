"""Which pages a sliding-window layer needs: the window tail of a prefix, SWA keep sets.

Resuming at prefix length P (tokens, page-aligned) needs SWA KV for the pages covering the
W tokens before P: pages tail_start(P) .. P/ps - 1. A prefix is *window-safe* when all of
them hold live SWA KV. Lengths here are in pages unless a name says tokens.
"""
from __future__ import annotations

from collections.abc import Iterable


def tail_start_page(end_page: int, page_size: int, window: int) -> int:
    """First page a request resuming at `end_page` pages needs SWA KV for."""
    return max(0, (end_page * page_size - window) // page_size)


def tail_pages(end_page: int, page_size: int, window: int) -> int:
    """How many pages before `end_page` must hold live SWA KV (at most ceil(W/ps) + 1)."""
    return end_page - tail_start_page(end_page, page_size, window)


def swa_keep_pages(num_pages: int, page_size: int, window: int, ends: Iterable[int] = (),
                   checkpoint_pages: int = 0) -> set[int]:
    """Page indices whose SWA KV a finished request should keep for the prefix cache.

    Keeps the window tail of the sequence end (num_pages), of every extra end in `ends`
    (e.g. the point where the request branched off the tree, MatchResult.present_len),
    and of every checkpoint at a multiple of `checkpoint_pages` (0 = none). Everything
    else can go back to the SWA pool: the SWA cost of a cached prefix is O(W) per end.
    """
    if num_pages < 0 or checkpoint_pages < 0:
        raise ValueError("num_pages and checkpoint_pages must be >= 0")
    points = {num_pages} | {e for e in ends if 0 < e <= num_pages}
    if checkpoint_pages:
        points.update(range(checkpoint_pages, num_pages + 1, checkpoint_pages))
    keep: set[int] = set()
    for end in points:
        keep.update(range(tail_start_page(end, page_size, window), end))
    return keep
