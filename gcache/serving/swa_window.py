"""Which pages a sliding-window layer needs: the window tail of a prefix, the last window-safe
end (which pages a cache keeps: the checkpoint rule, checkpoints.py).

Resuming at prefix length P (tokens, page-aligned) needs SWA KV for the pages covering the
W tokens before P: pages tail_start(P) .. P/ps - 1. A prefix is *window-safe* when all of
them hold live SWA KV. Lengths here are in pages unless a name says tokens.
"""

from __future__ import annotations

from collections.abc import Callable


def tail_start_page(end_page: int, page_size: int, window: int) -> int:
    """First page a request resuming at `end_page` pages needs SWA KV for."""
    return max(0, (end_page * page_size - window) // page_size)


def tail_pages(end_page: int, page_size: int, window: int) -> int:
    """How many pages before `end_page` must hold live SWA KV (at most ceil(W/ps) + 1)."""
    return end_page - tail_start_page(end_page, page_size, window)


def window_pages(page_size: int, window: int) -> int:
    """The pages of the window tail of an end past the window: ceil(W / page_size)."""
    return -(-window // page_size)


def last_safe_end(start_page: int, full_pages: int, has_swa: Callable[[int], bool], page_size: int, window: int) -> int:
    """Largest end page E in [start_page, start_page + full_pages] a request can resume at
    when pages [0, start_page) are already covered (start_page is 0 or a window-safe point of
    a lower tier, whose window tail is live) and pages [start_page, start_page + full_pages)
    have full KV here: every page of E's window tail at or after start_page must satisfy
    has_swa(page). Returns start_page when no later end qualifies."""
    best, run = start_page, 0
    for i in range(start_page, start_page + full_pages):
        run = run + 1 if has_swa(i) else 0
        end = i + 1
        if run >= end - max(start_page, tail_start_page(end, page_size, window)):
            best = end
    return best
