"""Helpers of the SGLang integration group (importable without torch or sglang)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_NOTE = HERE.parent.parent / ".venv-sglang" / ".gcache-sglang-unavailable"


def missing_packages() -> str | None:
    """Why the group cannot run in this Python, or None when it can."""
    absent = [name for name in ("torch", "sglang", "numpy") if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    why = f"{', '.join(absent)} not installed in this Python"
    if VENV_NOTE.exists():
        why += f"; tests/integrations/setup_venv.sh said: {VENV_NOTE.read_text().strip()}"
    return why


MISSING = missing_packages()


def chain(pages: int, page_size: int = 4, salt: int = 0) -> list[str]:
    """SGLang page hashes (gcache.wire.keys.page_hashes == sglang's get_hash_str chain) of a prompt."""
    from gcache.wire.keys import page_hashes

    tokens = [(salt * 7919 + i * 31) % 50000 for i in range(pages * page_size)]
    return page_hashes(tokens, page_size)


def slots(pool, pages: list[int]):
    """Host indices (token slots) of these page numbers, in order."""
    import torch

    return torch.cat([pool.page_slots(p) for p in pages])


def page_bytes(pool, page: int) -> bytes:
    """The page's bytes as SGLang's own get_data_page(flat) sees them."""
    import torch

    return pool.get_data_page(page * pool.page_size).contiguous().view(torch.uint8).numpy().tobytes()


def zero_pages(pool) -> list[int]:
    """Page numbers whose bytes are all zero (never written)."""
    return [p for p in range(pool.page_num) if not any(page_bytes(pool, p))]
