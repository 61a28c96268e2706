"""docs/layout.md shows the layer tables the tests enforce (tests/support/layers.py)."""

from tests.support.layout_doc import LAYOUT, rendered


def test_layout_doc_is_up_to_date():
    text = LAYOUT.read_text()
    assert rendered(text) == text, "docs/layout.md is out of date: python -m tests.support.layout_doc"
