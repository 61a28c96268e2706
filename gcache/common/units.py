"""Sizes and durations as people write them, the one parser for every flag, config file and bench.

Sizes: plain bytes (4096), binary units (KiB, MiB, GiB, TiB; K, M, G, T alone are binary too, as
in `--value-size 256K`), and decimal units (KB, MB, GB, TB). Durations: seconds (10, 10s), ms, m,
min. A value that is not understood raises ConfigError (a ValueError) saying what to write.
"""

from __future__ import annotations

import re

from gcache.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str | int) -> int:
    """'64MiB' -> 67108864, '256K' -> 262144, '500MB' -> 500000000, 4096 -> 4096."""
    if isinstance(text, bool):
        raise ConfigError(f"size {text!r} is not a number of bytes")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size {text} is negative")
        return text
    match = _NUMBER_UNIT.match(str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"size {text!r} is not understood; write e.g. 4096, 64MiB, 1GiB or 500MB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_duration(text: str | float) -> float:
    """'10s' -> 10.0, '500ms' -> 0.5, '2m' -> 120.0, 3 -> 3.0."""
    if isinstance(text, bool):
        raise ConfigError(f"duration {text!r} is not a number of seconds")
    if isinstance(text, (int, float)):
        return float(text)
    match = _NUMBER_UNIT.match(str(text))
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ConfigError(f"duration {text!r} is not understood; write e.g. 10s, 500ms or 2m")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def format_size(size_bytes: int) -> str:
    """262144 -> '256KiB'; sizes that are not a whole number of a unit stay in bytes."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale}{unit}"
    return f"{size_bytes}B"
