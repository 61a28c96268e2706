"""The layer tables, one home: tests/unit/test_import_layers.py enforces PYTHON_LAYERS on the
gcache package, tests/unit/test_native_include_layers.py enforces NATIVE_LAYERS on
gcache_native/, and docs/layout.md shows both (written by `python -m tests.support.layout_doc`).

Each row is (rooms, what they hold), lowest first. A room may use its own room and the rooms on
lower rows, never a room on its own row or above.
"""

from __future__ import annotations

PYTHON_LAYERS: list[tuple[list[str], str]] = [
    (["gcache.errors", "gcache._native"], "leaves"),
    (["gcache.common"], "sizes, addresses, breaker, processes"),
    (["gcache.wire"], "frames, keys, tokens"),
    (["gcache.cluster"], "the map, placement, the master's API"),
    (["gcache.client"], "the client"),
    (["gcache"], "the facade: `gcache.Client`, `__version__`"),
    (["gcache.server", "gcache.master", "gcache.cli"], "the daemons and the operators' CLI"),
    (["gcache.serving"], "the worker <-> router contract, HTTP pieces"),
    (
        ["gcache.serving.announce"],
        "what an engine holds, announced to the routers: the KV-event wire, the Redis writer, the bridge loop, engine kinds",
    ),
    (["gcache.router.ingest"], "the router's ingest: vLLM's KV events and GCache's L3 events into Redis"),
    (["gcache.worker", "gcache.router"], "worker foundation (config, backend, integrity); the router"),
    (["gcache.worker.kvcache"], "the prefix cache across tiers"),
    (["gcache.worker.model"], "the model: the batched forward, its MTP blocks"),
    (["gcache.worker.engine"], "the scheduler, the step loop and its decoding strategies"),
    (["gcache.worker.http"], "the worker's outside"),
    (["gcache.integrations.common"], "what every engine adapter shares: guarded store calls, settings"),
    (
        [
            "gcache.integrations.vllm.transfer",
            "gcache.integrations.vllm.events",
            "gcache.integrations.vllm.interval_stats",
        ],
        "vLLM: moving pages; the L3 events; vLLM's connector-stats contract",
    ),
    (["gcache.integrations.vllm.kv"], "vLLM's KV connector: its two halves, plan, groups (state groups too), keys"),
    (["gcache.integrations.vllm.ec"], "vLLM's encoder-cache connector"),
    (["gcache.integrations.vllm", "gcache.integrations.sglang"], "the vLLM and SGLang adapters' front doors"),
    (["gcache.integrations"], "engine adapters"),
    (["gcache.testing"], "fixtures the tests and benches share (never the product's)"),
    (["gcache.tools.plotting"], "the benches' charts (matplotlib, optional)"),
    (["gcache.tools.devcluster"], "launchers, local clusters"),
    (["gcache.tools.storebench"], "the gcache-bench harness"),
    (["gcache.tools"], "gcache-demo"),
]

# Top-level packages of the repository that gcache must never import (any import, anywhere).
NEVER_IMPORTED_BY_GCACHE = ["bench", "tests"]

# Folders of gcache_native/, by what their `#include "folder/..."` lines may name.
NATIVE_LAYERS: list[tuple[list[str], str]] = [
    (["common"], "leaves: arena, checksums, frame header, metrics, key limits, GCACHE_ASSERT"),
    (["disk"], "segment files and their records"),
    (["core"], "what the store and its eviction policies share: Entry, OwnerId"),
    (["eviction"], "the EvictionPolicy contract and its policies"),
    (["store"], "the Store and its parts"),
    (["server", "client"], "the data server; the client's native helpers"),
    (["bindings"], "the pybind11 module"),
]


def rooms(layers: list[tuple[list[str], str]]) -> list[list[str]]:
    """The rooms of each row, lowest first."""
    return [names for names, _ in layers]


def rows(layers: list[tuple[list[str], str]]) -> dict[str, int]:
    """{room: its row}."""
    return {name: row for row, (names, _) in enumerate(layers) for name in names}
