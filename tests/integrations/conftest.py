"""The SGLang integration group: GCache as SGLang 0.5.23's HiCache storage backend.

It runs in its own venv (tests/integrations/setup_venv.sh builds .venv-sglang with
torch 2.13.0 CPU and sglang 0.5.23 --no-deps):

    bash tests/integrations/setup_venv.sh
    GCACHE_SGLANG_GROUP=1 .venv-sglang/bin/python -m pytest -q tests/integrations

In any other Python (the main .venv's `pytest`), torch / sglang are absent and this
folder is left out of collection. With GCACHE_SGLANG_GROUP=1 and the packages missing
(the setup script could not install them), test_sglang_available.py alone runs
and skips with the reason. The sglang package is registered without running its
heavy __init__ (gcache.testing.sglang_modules.load_sglang_storage).
"""

from __future__ import annotations

import os

import pytest

from .sglang_support import HERE, MISSING

if MISSING:
    collect_ignore = [p.name for p in HERE.glob("test_*.py") if p.name != "test_sglang_available.py"]
    if not os.environ.get("GCACHE_SGLANG_GROUP"):
        collect_ignore.append("test_sglang_available.py")

if not MISSING:
    from gcache.testing.sglang_modules import HostPoolStandIn, load_sglang_storage

    DYNAMIC = {
        "backend_name": "gcache",
        "module_path": "gcache.integrations.sglang",
        "class_name": "GCacheHiCacheStorage",
    }
    MODEL = "org/model"

    @pytest.fixture(scope="session")
    def sgl():
        """(hicache_storage module, StorageBackendFactory) of the installed sglang."""
        return load_sglang_storage()

    @pytest.fixture
    def storage_config(sgl):
        """Builds SGLang's real HiCacheStorageConfig; extra_config gets the dynamic-backend fields."""
        hicache_storage, _ = sgl

        def make(address: str | None, *, tp_rank=0, tp_size=1, is_mla=False, metrics=False, interface_v1=True, **extra):
            extra_config = dict(DYNAMIC, **extra)
            if address is not None:
                extra_config["gcache_url"] = address
            if interface_v1:
                extra_config["interface_v1"] = 1
            return hicache_storage.HiCacheStorageConfig(
                tp_rank=tp_rank,
                tp_size=tp_size,
                pp_rank=0,
                pp_size=1,
                attn_cp_rank=0,
                attn_cp_size=1,
                is_mla_model=is_mla,
                enable_storage_metrics=metrics,
                is_page_first_layout=True,
                model_name=MODEL,
                extra_config=extra_config,
            )

        return make

    @pytest.fixture
    def attach(sgl):
        """attach(config, host_pool, **v2_pools): what SGLang's controller does on attach.

        The factory creates the backend (cls(storage_config, kwargs)), then
        register_mem_pool_host, then register_mem_host_pool_v2 per pool, then
        on_host_pools_registered. Every backend is closed at teardown.
        """
        _, factory = sgl
        made = []

        def attach_(config, host_pool, v2_pools: dict | None = None):
            backend = factory.create_backend("dynamic", config, host_pool)
            made.append(backend)
            backend.register_mem_pool_host(host_pool)
            for name, pool in (v2_pools or {}).items():
                backend.register_mem_host_pool_v2(pool, name)
            backend.on_host_pools_registered()
            return backend

        yield attach_
        for backend in made:
            backend.close()

    @pytest.fixture
    def host_pool():
        """host_pool(layout, ...) -> a CPU MHA host pool running SGLang's own page code.

        SGLang's MHATokenToKVPoolHost cannot be built on this CPU-only machine (see
        gcache/testing/sglang_modules.py): this stand-in runs its methods unchanged.
        """

        def make(
            layout="page_first", *, page_size=4, pages=16, layer_num=3, head_num=2, head_dim=8, seed=None, label="kv"
        ):
            import torch

            pool = HostPoolStandIn(
                layout=layout,
                page_size=page_size,
                pages=pages,
                layer_num=layer_num,
                head_num=head_num,
                head_dim=head_dim,
                label=label,
            )
            if seed is not None:
                raw = pool.kv_buffer.view(-1).view(torch.uint8)
                gen = torch.Generator().manual_seed(seed)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
            return pool

        return make
