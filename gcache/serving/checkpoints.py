"""The checkpoint rule, one home: the prefix lengths (in pages) at which a cache keeps a sliding
window's KV so that a later request can resume there.

A sequence of n whole pages has these checkpoints: every C pages (C = `every`, 0 = none), its
end (n), the resend point (a resend of the same tokens must leave a token to compute, so a
page-aligned end resumes one page earlier) and the point where it branched off a cached prefix.
Resuming at checkpoint p needs the SWA KV of p's window tail (swa_window.tail_start_page), so a
cache holds O(W) SWA per checkpoint. The worker's cache (kvcache/swa_checkpoints.py), the
speculator's MTP tails (engine/speculative.py) and the vLLM connector's plan
(integrations/vllm/kv/plan.py) all take their points and tails from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gcache.serving.swa_window import tail_start_page


@dataclass(frozen=True)
class CheckpointRule:
    page_size: int  # tokens per page
    every: int = 0  # C: a checkpoint every C pages (0: ends and branch points only)

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.every < 0:
            raise ValueError("page_size must be > 0 and every >= 0")

    def periodic(self, lo_page: int, hi_page: int) -> list[int]:
        """The periodic checkpoints n with lo_page < n <= hi_page, ascending."""
        c = self.every
        return list(range((lo_page // c + 1) * c, hi_page + 1, c)) if c else []

    def next_periodic(self, page: int) -> int | None:
        """The first periodic checkpoint after `page` (None without periodic checkpoints)."""
        c = self.every
        return (page // c + 1) * c if c else None

    def end_points(self, num_tokens: int) -> tuple[int, int]:
        """The resume points of a sequence's end: its whole pages, and the page a resend of the
        same tokens resumes at (one page earlier when the end is page-aligned)."""
        return num_tokens // self.page_size, (num_tokens - 1) // self.page_size

    def points(self, num_pages: int, ends: Iterable[int] = ()) -> set[int]:
        """Every checkpoint of a sequence of num_pages whole pages: its end, each of `ends`
        within it (the resend point, the branch point) and the periodic ones; never 0 (there is
        nothing to resume at 0)."""
        found = {p for p in (num_pages, *ends) if 0 < p <= num_pages}
        found.update(self.periodic(0, num_pages))
        return found

    def prompt_points(self, num_tokens: int) -> set[int]:
        """A prompt's checkpoints: its end points and the periodic ones up to its whole pages."""
        whole, resend = self.end_points(num_tokens)
        return self.points(whole, (resend,))

    def in_a_tail(self, page: int, num_pages: int, window: int, ends: Iterable[int] = ()) -> bool:
        """Whether `page` lies in the window tail of a checkpoint p, page < p <= num_pages: one of
        `ends` (num_pages itself only when among them: a re-lock point mid-decode is no
        checkpoint) or a periodic one. The periodic one to ask is the first after `page`: a
        later one's tail starts no earlier."""
        points = list(ends)
        periodic = self.next_periodic(page)
        if periodic is not None:
            points.append(periodic)
        return any(page < p <= num_pages and tail_start_page(p, self.page_size, window) <= page for p in points)

    def keep_pages(self, num_pages: int, window: int, ends: Iterable[int] = ()) -> set[int]:
        """Page indices whose SWA KV a sequence of num_pages whole pages keeps for the prefix
        cache: the window tails of its checkpoints (points(num_pages, ends)). Everything else can
        go back to the SWA pool: the SWA cost of a cached prefix is O(W) per checkpoint."""
        if num_pages < 0:
            raise ValueError("num_pages must be >= 0")
        keep: set[int] = set()
        for end in self.points(num_pages, ends):
            keep.update(range(tail_start_page(end, self.page_size, window), end))
        return keep

    def prompt_keep_pages(self, num_tokens: int, window: int) -> set[int]:
        """keep_pages of a prompt: the window tails of its prompt_points."""
        whole, resend = self.end_points(num_tokens)
        return self.keep_pages(whole, window, (resend,))
