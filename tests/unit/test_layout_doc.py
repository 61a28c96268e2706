"""docs/layout.md shows the room and layer tables from tests/support/rooms.py and layers.py, and
every room of the layer table has its row of prose."""

from glob import glob
from pathlib import Path

from tests.support.layers import NATIVE_LAYERS, PYTHON_LAYERS, rows
from tests.support.layout_doc import LAYOUT, rendered
from tests.support.rooms import NATIVE_FOLDERS, PYTHON_ROOMS, module_of

ROOT = Path(__file__).resolve().parents[2]


def test_layout_doc_is_up_to_date():
    text = LAYOUT.read_text()
    assert rendered(text) == text, "docs/layout.md is out of date: python -m tests.support.layout_doc"


def test_every_python_room_of_the_layer_table_has_one_row():
    described = [module_of(r.path) for r in PYTHON_ROOMS]
    assert len(described) == len(set(described)), "a room has two rows in tests/support/rooms.py"
    layered = set(rows(PYTHON_LAYERS))
    assert set(described) - layered == set(), "rows in tests/support/rooms.py for rooms the layer table lacks"
    assert layered - set(described) == set(), "rooms of the layer table with no row in tests/support/rooms.py"


def test_every_native_folder_has_one_row():
    described = [f.folder for f in NATIVE_FOLDERS]
    assert sorted(described) == sorted(rows(NATIVE_LAYERS)), "tests/support/rooms.py: NATIVE_FOLDERS vs NATIVE_LAYERS"


def built_or_buildable(path: str) -> bool:
    """The native module's row names the built file; a tree not built yet has its source."""
    return bool(glob(str(ROOT / path))) or (module_of(path) == "gcache._native" and (ROOT / "gcache_native").is_dir())


def test_every_path_named_exists():
    missing = [r.path for r in PYTHON_ROOMS if not built_or_buildable(r.path)]

    missing += [
        f"gcache_native/{f.folder}/" for f in NATIVE_FOLDERS if not (ROOT / "gcache_native" / f.folder).is_dir()
    ]
    assert missing == []
