"""gcache.common.breaker: suspect for suspect_s after a failure, on an explicit clock."""

from __future__ import annotations

import pytest

from gcache.common.breaker import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_suspect_for_exactly_suspect_s_after_each_failure():
    clock = Clock()
    b = Breaker(2.0, clock=clock)
    assert not b.is_suspect() and not b.is_down()
    assert b.fail() is True  # starts an outage
    assert b.is_suspect()
    clock.now = 101.999
    assert b.is_suspect()
    clock.now = 102.0
    assert not b.is_suspect() and b.is_down()  # the window ended; still down until it answers
    assert b.fail() is False  # the same outage: not a new one
    clock.now = 103.5
    assert b.is_suspect()
    assert b.succeed() is True and not b.is_suspect() and not b.is_down()
    assert b.succeed() is False


def test_keys_are_independent_and_retain_forgets_the_others():
    clock = Clock()
    b = Breaker(1.0, clock=clock)
    b.fail("a")
    clock.now += 0.5
    b.fail("b")
    assert b.suspects() == ["a", "b"]
    clock.now += 0.6
    assert b.suspects() == ["b"] and not b.is_suspect("a") and b.is_suspect("b")
    b.retain(["a"])
    assert not b.is_suspect("b") and b.is_down("a") and not b.is_down("b")


def test_bounded_drops_the_key_whose_window_ends_first():
    clock = Clock()
    b = Breaker(1.0, clock=clock, keys_max=2)
    b.fail("a")
    clock.now += 0.1
    b.fail("b")
    clock.now += 0.1
    b.fail("c")
    assert not b.is_down("a") and b.is_suspect("b") and b.is_suspect("c")


def test_zero_window_never_skips_and_bad_arguments_are_refused():
    b = Breaker(0.0)
    b.fail()
    assert not b.is_suspect() and b.is_down()
    with pytest.raises(ValueError):
        Breaker(-1.0)
    with pytest.raises(ValueError):
        Breaker(1.0, keys_max=0)
