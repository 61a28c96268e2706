"""Writes docs/layout.md's tables between the markers `<!-- layers:NAME begin -->` and
`<!-- layers:NAME end -->`: the layer tables (NAME: python, native) from tests/support/layers.py
and the room tables (NAME: rooms, native-rooms) from tests/support/rooms.py.

    python -m tests.support.layout_doc          # rewrites docs/layout.md
    python -m tests.support.layout_doc --check  # exits 1 when it is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.support.layers import NATIVE_LAYERS, PYTHON_LAYERS
from tests.support.rooms import NATIVE_FOLDERS, PYTHON_ROOMS

LAYOUT = Path(__file__).resolve().parents[2] / "docs" / "layout.md"


def table(layers: list[tuple[list[str], str]]) -> str:
    lines = ["| row | rooms | what |", "|---|---|---|"]
    lines += [f"| {row} | {', '.join(f'`{n}`' for n in names)} | {note} |" for row, (names, note) in enumerate(layers)]
    return "\n".join(lines)


def rooms_table() -> str:
    lines = ["| room | product | what lives there |", "|---|---|---|"]
    lines += [f"| `{r.path}` | {r.product.value} | {r.what} |" for r in PYTHON_ROOMS]
    return "\n".join(lines)


def native_rooms_table() -> str:
    lines = ["| folder | what lives there |", "|---|---|"]
    lines += [f"| `{f.folder}/` | {f.what} |" for f in NATIVE_FOLDERS]
    return "\n".join(lines)


def tables() -> dict[str, str]:
    return {
        "rooms": rooms_table(),
        "native-rooms": native_rooms_table(),
        "python": table(PYTHON_LAYERS),
        "native": table(NATIVE_LAYERS),
    }


def rendered(text: str) -> str:
    for name, body in tables().items():
        begin, end = f"<!-- layers:{name} begin -->", f"<!-- layers:{name} end -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise SystemExit(f"layout_doc: {LAYOUT} has no {begin} ... {end} section")
        text = pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)
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
