"""The native core's shape, checked: every `#include "folder/file"` in gcache_native/ names a
file that exists, and a folder includes only its own folder and the folders on lower rows of
NATIVE_LAYERS (tests/support/layers.py), never one on its own row or above."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.layers import NATIVE_LAYERS, rows

NATIVE = Path(__file__).resolve().parents[2] / "gcache_native"
ROW = rows(NATIVE_LAYERS)
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def sources() -> list[Path]:
    return sorted(p for p in NATIVE.rglob("*") if p.suffix in (".h", ".cpp"))


def includes() -> list[tuple[Path, int, str]]:
    """(file, line number, included path) for every quoted include."""
    found = []
    for path in sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = INCLUDE.match(line)
            if match:
                found.append((path, number, match.group(1)))
    return found


def folder_of(path: Path) -> str:
    return path.relative_to(NATIVE).parts[0]


def test_every_folder_has_a_row():
    folders = {folder_of(p) for p in sources()}
    missing = sorted(folders - set(ROW))
    assert not missing, f"gcache_native folders in no row of NATIVE_LAYERS: {missing}: add them there"


def test_every_include_names_a_file_from_the_root():
    wrong = [f"{p.relative_to(NATIVE)}:{n}: {inc}" for p, n, inc in includes() if not (NATIVE / inc).is_file()]
    assert not wrong, 'includes are spelled from gcache_native/ ("folder/file.h"):\n' + "\n".join(wrong)


def test_no_folder_includes_a_folder_above_or_beside_its_own():
    wrong = []
    for path, number, included in includes():
        mine, theirs = folder_of(path), included.split("/")[0]
        if theirs != mine and theirs in ROW and ROW[theirs] >= ROW[mine]:
            wrong.append(
                f"{path.relative_to(NATIVE)}:{number}: {included} ({mine} row {ROW[mine]}, {theirs} row {ROW[theirs]})"
            )
    assert not wrong, "includes that run up or sideways:\n" + "\n".join(wrong)
