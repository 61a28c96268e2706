"""Integrity checks that survive `python -O` (which strips assert statements)."""

from __future__ import annotations


class IntegrityError(AssertionError):
    """A cache structure broke one of its invariants: a bug, never bad user input."""


def require(condition: object, message: str) -> None:
    if not condition:
        raise IntegrityError(message)
