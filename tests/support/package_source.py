"""The gcache package's source, parsed once per test run: the shape tests (import layers,
the one host:port parser) walk the same trees. Shared, so read-only: never mutate them."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gcache"


@functools.cache
def parsed() -> dict[Path, ast.Module]:
    """{path: module tree} for every .py file under gcache/, sorted by path."""
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}
