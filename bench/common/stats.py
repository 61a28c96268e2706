"""Summaries of repeated measurements, the one home for the benches' min / median / max."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable


def spread(values: Iterable[float]) -> tuple[float, float, float]:
    """(min, median, max) of the samples, as floats."""
    v = [float(x) for x in values]
    return min(v), float(statistics.median(v)), max(v)


def columns(values: Iterable[float], fmt: str = "{:9.2f}", scale: float = 1, sep: str = " ") -> str:
    """'min median max' (joined by sep), each value x scale through fmt."""
    return sep.join(fmt.format(x * scale) for x in spread(values))


def median_range(values: Iterable[float], fmt: Callable[[float], str]) -> str:
    """'median [min..max]' through fmt; the value alone when there is one sample."""
    v = [float(x) for x in values]
    if len(v) == 1:
        return fmt(v[0])
    lo, mid, hi = spread(v)
    return f"{fmt(mid)} [{fmt(lo)}..{fmt(hi)}]"
