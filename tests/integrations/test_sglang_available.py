"""The group's packages: the pinned torch and sglang, or one skip that says why not."""

from __future__ import annotations

import importlib.metadata

import pytest

from .sglang_support import MISSING


def test_pinned_torch_and_sglang_are_installed():
    if MISSING:
        pytest.skip(f"SGLang integration group not run: {MISSING}")
    import torch

    assert torch.__version__.split("+")[0] == "2.13.0"
    assert not torch.cuda.is_available()  # the CPU build: the group needs no GPU
    assert importlib.metadata.version("sglang") == "0.5.23"
