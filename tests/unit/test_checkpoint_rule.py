"""The checkpoint rule (gcache/serving/checkpoints.py): the one home of where a cache keeps SWA
KV, used by the worker's cache, the speculator's MTP tails and the vLLM connector's plan."""

from __future__ import annotations

import pytest

from gcache.serving.checkpoints import CheckpointRule


def test_periodic_points_lie_strictly_after_lo_and_up_to_hi():
    rule = CheckpointRule(16, every=4)
    assert rule.periodic(0, 12) == [4, 8, 12]
    assert rule.periodic(4, 11) == [8]  # lo itself is not after lo
    assert rule.periodic(5, 5) == []
    assert rule.next_periodic(3) == 4 and rule.next_periodic(4) == 8
    assert CheckpointRule(16).periodic(0, 100) == [] and CheckpointRule(16).next_periodic(7) is None


def test_end_points_are_the_whole_pages_and_the_resend_point():
    rule = CheckpointRule(16)
    assert rule.end_points(40) == (2, 2)  # mid-page end: a resend resumes at its whole pages
    assert rule.end_points(48) == (3, 2)  # page-aligned: a resend leaves a token, one page earlier


def test_points_take_the_end_the_given_ends_within_it_and_the_periodic_ones_never_zero():
    rule = CheckpointRule(4, every=4)
    assert rule.points(10, ends=(3, 11, 0)) == {3, 4, 8, 10}
    assert rule.points(0) == set()
    assert CheckpointRule(32, 16).prompt_points(576) == {16, 17, 18}
    assert CheckpointRule(32, 16).prompt_points(20) == set()


def test_keep_pages_are_the_window_tails_of_the_points():
    assert CheckpointRule(4, every=4).keep_pages(12, 8, ends=[5]) == {2, 3, 4, 6, 7, 10, 11}
    with pytest.raises(ValueError):
        CheckpointRule(4).keep_pages(-1, 8)
    with pytest.raises(ValueError):
        CheckpointRule(4, every=-1)
