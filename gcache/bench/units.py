"""Parsing of human sizes ("256KiB") and durations ("10s")."""
from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0}


def parse_size(text: str | int) -> int:
    """'256KiB' -> 262144. Bare numbers are bytes; K/M/G alone are binary units."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"bad size {text!r}: use a number with an optional unit, e.g. 4KiB, 256KiB, 16MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_duration(text: str | float) -> float:
    """'10s' -> 10.0, '500ms' -> 0.5, '2m' -> 120.0."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"bad duration {text!r}: use e.g. 10s, 500ms, 2m")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def format_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale}{unit}"
    return f"{size_bytes}B"
