"""Writes docs/layout.md's layer tables from tests/support/layers.py, between the markers
`<!-- layers:NAME begin -->` and `<!-- layers:NAME end -->` (NAME: python, native).

    python -m tests.support.layout_doc          # rewrites docs/layout.md
    python -m tests.support.layout_doc --check  # exits 1 when it is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.support.layers import NATIVE_LAYERS, PYTHON_LAYERS

LAYOUT = Path(__file__).resolve().parents[2] / "docs" / "layout.md"
TABLES = {"python": PYTHON_LAYERS, "native": NATIVE_LAYERS}


def table(layers: list[tuple[list[str], str]]) -> str:
    lines = ["| row | rooms | what |", "|---|---|---|"]
    lines += [f"| {row} | {', '.join(f'`{n}`' for n in names)} | {note} |" for row, (names, note) in enumerate(layers)]
    return "\n".join(lines)


def rendered(text: str) -> str:
    for name, layers in TABLES.items():
        begin, end = f"<!-- layers:{name} begin -->", f"<!-- layers:{name} end -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise SystemExit(f"layout_doc: {LAYOUT} has no {begin} ... {end} section")
        text = pattern.sub(lambda _: f"{begin}\n{table(layers)}\n{end}", text)
    return text


def main() -> int:
    text = LAYOUT.read_text()
    new = rendered(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            print("layout_doc: docs/layout.md is out of date: python -m tests.support.layout_doc")
            return 1
        return 0
    LAYOUT.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
