"""Which prefixes of a page chain can be restored, from per-entry EXISTS answers.

Pure functions (no store, no torch) so the rules can be read and tested alone.
A page counts only when every one of its entries (K and V, every layer) is
there. For hybrid models SGLang asks per pool: `all_pages` pools must hold every
page of the prefix, `trailing_pages` pools (SWA, Mamba state) only the last
`window` pages before the cut, so 5 pages can be restorable while 4 are not.
"""

from __future__ import annotations

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"


def pages_present(flags: list[bool], per_page: int) -> list[bool]:
    """Per page: are all `per_page` consecutive entry flags true?"""
    return [all(flags[i : i + per_page]) for i in range(0, len(flags), per_page)]


def leading_pages(present: list[bool]) -> int:
    for i, ok in enumerate(present):
        if not ok:
            return i
    return len(present)


def restorable_cuts(kv_pages: int, policy: str, window: int, present: list[bool]) -> list[int]:
    """The prefix lengths in [1, kv_pages] one pool can serve, ascending."""
    if policy == ALL_PAGES:
        return list(range(1, leading_pages(present[:kv_pages]) + 1))
    if policy == TRAILING_PAGES:
        window = max(1, window)
        return [cut for cut in range(1, kv_pages + 1) if all(present[max(0, cut - window) : cut])]
    raise ValueError(f"hit policy {policy!r} is not supported by the GCache backend")


def fold(
    kv_pages: int, pools: list[tuple[object, str, int, list[bool]]], kv_name: object = "kv"
) -> tuple[int, dict[object, int], list[int]]:
    """(final pages, per-pool boundary, restorable cuts) over the KV prefix and every pool.

    pools: (name, policy, window, per-page presence for the first kv_pages pages).
    A pool's boundary is its own longest servable cut; the final cut is the longest
    one every pool can serve. Names are used as given: SGLang looks its pools up by
    PoolName members, whose hash is not their string value's.
    """
    hits: dict[object, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for name, policy, window, present in pools:
        if not restorable:
            break
        cuts = restorable_cuts(kv_pages, policy, window, present)
        if cuts:
            hits[name] = cuts[-1]
        allowed = set(cuts)
        restorable = [cut for cut in restorable if cut in allowed]
    return (restorable[-1] if restorable else 0), hits, restorable
