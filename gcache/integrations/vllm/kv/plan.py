"""Which pages a request loads and saves: pure functions over page counts (no vLLM, no store).

A page is one vLLM block of one KV cache group. Full-attention groups keep every page.
Sliding-window groups keep only the window tails of *checkpoints*: the cuts at every C pages
and at the prompt's end (the cut a repeat of the prompt resumes at, (len - 1) // block_size,
and the one a longer prompt resumes at, len // block_size): the checkpoint rule
(gcache.serving.checkpoints), its points and window tails. Resuming at cut n needs, per
sliding-window group, the pages of n's window tail (vLLM's cdiv(window - 1, block_size)); a
hit is the longest cut every group can serve. A state group (state_groups.py) serves cut n only
with its state at exactly n (its "page" n - 1): the search runs from the right.
"""

from __future__ import annotations

from gcache.serving.checkpoints import CheckpointRule
from gcache.serving.swa_window import window_pages


def rule_window(window: int) -> int:
    """A vLLM sliding window in the checkpoint rule's terms (the tokens before a cut): vLLM's
    window counts the token being computed, so a cut needs window - 1 tokens before it
    (SlidingWindowManager), and at least one page."""
    return max(1, window - 1)


def sliding_tail_pages(window: int, block_size: int) -> int:
    """Pages a sliding-window group needs before a cut past its window (a Group's tail)."""
    return window_pages(block_size, rule_window(window))


def prompt_cuts(prompt_len: int, block_size: int, every: int) -> set[int]:
    """The checkpoint cuts of a prompt, in pages (the checkpoint rule's prompt points)."""
    return CheckpointRule(block_size, every).prompt_points(prompt_len)


def prompt_tail_pages(prompt_len: int, block_size: int, every: int, tail: int) -> set[int]:
    """The pages a sliding-window group whose cuts need `tail` pages (its Group.tail) saves of
    a prompt: the window tails of the prompt's cuts (the rule's prompt_keep_pages; a tail of
    T pages is a window of T * block_size tokens in the rule's terms)."""
    return CheckpointRule(block_size, every).prompt_keep_pages(prompt_len, tail * block_size)


def loadable_pages(prompt_len: int, block_size: int, last_page: bool) -> int:
    """The prompt pages a hit may cover. vLLM computes at least the prompt's last token, so a
    hit stops before the page holding it; but when the prompt ends on a page boundary and
    `last_page` allows it (full-attention groups only), the last page is loaded whole and
    vLLM recomputes its last token alone, over the loaded value (hit_tokens: prompt_len - 1).
    A state group must not: its state at the last cut already includes that last token."""
    if last_page and prompt_len > 0 and prompt_len % block_size == 0:
        return prompt_len // block_size
    return max(0, prompt_len - 1) // block_size


def hit_tokens(prompt_len: int, end_pages: int, block_size: int, num_computed_tokens: int) -> int:
    """The tokens vLLM is told a hit of pages [.., end_pages) brings past its own
    `num_computed_tokens`: never the prompt's last token, which vLLM computes."""
    return min(end_pages * block_size, prompt_len - 1) - num_computed_tokens


def loaded_pages(num_external_tokens: int, block_size: int) -> int:
    """The pages vLLM allocated for a hit of `num_external_tokens` past a block-aligned local
    hit: a partly reported last page (the prompt's, hit_tokens) is a whole page loaded."""
    return -(-num_external_tokens // block_size)


def best_cut(
    local: int, full_end: int, swa: list[tuple[int, list[bool]]], states: list[list[bool]] | None = None
) -> int:
    """The longest cut n in (local, full_end] that every sliding-window and state group can
    serve, or local.

    swa: per sliding-window group (tail, present) where present[i] says page local + i is
    stored. Pages before `local` are vLLM's own (its local prefix hit), so they count as there.
    states: per state group, present[i] says its state at cut local + i + 1 is stored.
    """
    for n in range(full_end, local, -1):
        if all(present[n - 1 - local] for present in states or ()) and all(
            all(present[p - local] for p in range(max(local, n - tail), n)) for tail, present in swa
        ):
            return n
    return local


def leading(flags: list[bool], per_page: int) -> int:
    """Leading pages whose `per_page` consecutive flags are all true."""
    pages = 0
    for i in range(0, len(flags) - per_page + 1, per_page):
        if not all(flags[i : i + per_page]):
            break
        pages += 1
    return pages
