"""What lives in each room, one home: docs/layout.md's prose tables are written from these
(`python -m tests.support.layout_doc`), and tests/unit/test_layout_doc.py checks that every
Python room of the layer table (tests/support/layers.py) has exactly one row here, every native
folder too, and that every path named exists.

A new room: its layer row in layers.py, its row here, then `python -m tests.support.layout_doc`.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Product(Enum):
    """Which of the repository's products a room belongs to (docs/layout.md's first lines)."""

    ALL = "all"
    STORE = "store"
    INFERENCE = "inference"
    ADAPTERS = "adapters"
    TOOLING = "tooling"
    TESTS = "tests"


class Room(NamedTuple):
    """A row of "The Python package, by room": `path` as written in the table (a folder ends in
    "/"), the product it serves, and what lives there (markdown)."""

    path: str
    product: Product
    what: str


class NativeFolder(NamedTuple):
    """A row of the C++ core's table: a folder of gcache_native/ and what lives there."""

    folder: str
    what: str


PYTHON_ROOMS: list[Room] = [
    Room(
        "gcache/errors.py",
        Product.ALL,
        "every exception a caller may catch (`gcache.errors`), `ConfigError`",
    ),
    Room(
        "gcache/_native*.so",
        Product.STORE,
        "the C++ core (`gcache._native`), built from `gcache_native/` by the package's own build (below)",
    ),
    Room(
        "gcache/common/",
        Product.ALL,
        "leaves: `units` (the one size / duration parser), `address` (host:port), `breaker` (suspect a peer "
        "for N s after a failure), `processes` (child processes: free ports, wait, stop), `file_modes` "
        "(private data dirs, secret files), `host_checks` (the host settings `gcache doctor` checks), `flags` "
        "(argparse flags made from a config dataclass's fields), `attention` (`AttentionKind`: full / SWA)",
    ),
    Room(
        "gcache/wire/",
        Product.STORE,
        "the foundation every store part speaks: `protocol` (frame header, opcodes, limits, msgpack "
        "metadata), `keys` (the page-hash chain), `auth` (tenant files, tokens, challenge-response, bearer "
        "tokens), `rdma_verbs` (pyverbs wrappers)",
    ),
    Room(
        "gcache/cluster/",
        Product.STORE,
        "the cluster contract: `cluster_map` (epoch, nodes, states), `placement` (the rings: ketama, and "
        "`rendezvous`, weighted rendezvous hashing), `master_api` (the masters' gRPC API and its client)",
    ),
    Room(
        "gcache/client/",
        Product.STORE,
        "`gcache.Client`: the contract (`api`), the choice of implementation (`factory`), one node "
        "(`client`, `connection`, `pipeline`, `pool`, `operations`: the Python reference path, `native_core`: "
        "the native core behind it, `arena`: the one-sided transports' contract), one deadline per call (`deadline`), a cluster (`cluster_client`, `node_set`, "
        "`map_source`), `transports/` (tcp `base`, `shm`, `shm_ops`, `rdma`, `choose` for `auto`), `device/` "
        "(GPU arrays and pinned staging)",
    ),
    Room(
        "gcache/__init__.py",
        Product.STORE,
        "the facade: `gcache.Client` and `gcache.ClusterClient` (loaded lazily), the exceptions a caller "
        "catches, `__version__`",
    ),
    Room(
        "gcache/server/",
        Product.STORE,
        "`gcache-server` around the native data server: flags (`config`), lifecycle (`main`), admin HTTP / "
        "gRPC, Prometheus text, the cluster agent, rebalancing, disk degradation, RDMA registration",
    ),
    Room(
        "gcache/master/",
        Product.STORE,
        "`gcache-master`: Raft state, the map service, leader duties, health probes",
    ),
    Room(
        "gcache/cli/",
        Product.STORE,
        "`gcache`: `main` (put / get / exists / rm / stats / ping), `admin` (map / status / drain / remove) "
        "and `doctor` (the host checks)",
    ),
    Room(
        "gcache/serving/",
        Product.INFERENCE,
        "what the worker and the router share: the worker-router contract (`tokenizer`, `redis_layout`, "
        "`swa_window`: the window-safety rule, `checkpoints`: the checkpoint rule, `tiers`, `handoff`: PD "
        "roles and the handoff record) and the HTTP pieces (OpenAI parsing and bodies with `RequestKind`, "
        "SSE, limits, safe JSON)",
    ),
    Room(
        "gcache/serving/announce/",
        Product.INFERENCE,
        "what an engine holds, announced to the routers, one home for every producer (the worker's "
        "publisher, the vLLM translator, the L3 subscriber): `engines` (the engine object a registration "
        "carries: kind, models, bucket, L3), `bridge` (`EventBridge`: a ZMQ stream in, Redis out, on two "
        "threads, with the publisher's backoff and stop)",
    ),
    Room(
        "gcache/router/ingest/",
        Product.INFERENCE,
        "the router's ingest wing, engines' event streams into the routers' shared Redis state: "
        "`translator` (`gcache-router kv-events` and `--vllm`: a vLLM server's KV events as a worker's "
        "registration, pages and stream), `kv_events` (vLLM's KV-event wire, decoded and checked), "
        "`l3_events` (the GCache connectors' L3 events into the shared L3 view), `zmq_sub` (the ZMQ loop); "
        "routing never imports it, only `gcache-router`'s command line starts it",
    ),
    Room(
        "gcache/worker/",
        Product.INFERENCE,
        "`gcache-worker`; at its root the foundation (`config`: `ModelConfig`, `backend`: numpy / cupy, `integrity`)",
    ),
    Room(
        "gcache/router/",
        Product.INFERENCE,
        "`gcache-router`: its view of the workers from Redis (`state`, `core`), how much of a prompt each "
        "could resume (`match`), the policies, what it just sent where (`recent`), prompts tokenized as a "
        "vLLM server does (`engine_prompts`), the HTTP proxy (`server`), PD pairing (`pd_config`, "
        "`pd_policy`, `pd_server`)",
    ),
    Room(
        "gcache/worker/kvcache/",
        Product.INFERENCE,
        "the prefix cache across tiers: the `CacheManager` contract and its implementations (`tiered_cache`: "
        "`TieredPrefixCache`, coordinating the tiers; `prefix_cache_off`), its config, the write and prefetch "
        "policies, the SWA checkpoint policy (`swa_checkpoints`), the counters (`cache_stats`), device pools "
        "(`kv_pool`); `swa_tree/`: the L1 index (the SWA radix tree, its nodes, its eviction as an object it "
        "holds, its check); `tiers/`: the host pool and cache, L3 through GCache, layer-wise loads, the MTP "
        "tails",
    ),
    Room(
        "gcache/worker/model/",
        Product.INFERENCE,
        "the `BatchModel` and `MTPModel` contracts (`base`), the hybrid SWA transformer and its public layer "
        "API (`transformer`), the MTP blocks (`mtp`, `mtp_tail`), weights, the cost-only stand-in (`sim`)",
    ),
    Room(
        "gcache/worker/engine/",
        Product.INFERENCE,
        "requests, the scheduler and its policies, the batcher (admission, pages, preemption, release), the "
        "step loop (schedule / forward / postprocess), the decoding strategies (`decoding`: plain; "
        "`speculative`: MTP), the engine thread, metrics",
    ),
    Room(
        "gcache/worker/http/",
        Product.INFERENCE,
        "the worker's outside: flags, the aiohttp server, completions, the Redis publisher, the PD endpoints "
        "(`pd_routes`, `pd_prefill`, `pd_flags`)",
    ),
    Room(
        "gcache/integrations/common/",
        Product.ADAPTERS,
        "what every adapter shares, importing no engine: `engine_boundary` (`EngineBoundary`: every hook an "
        "engine calls runs through it, so an exception is logged, counted and answered as a miss, never "
        "raised into the engine), `guarded_store` (the store calls that never raise), `connect` (a client "
        "answering at the engine's start, or a clear error), `store_settings` and `extra_config` (the "
        "`gcache_*` settings reader), `job_queue` (bounded savers and loaders on their own thread), "
        "`counters`",
    ),
    Room(
        "gcache/integrations/vllm/transfer/",
        Product.ADAPTERS,
        "vLLM: moving pages between its KV views and the store: the byte runs of a page (`page_runs`, "
        "`numpy_view`), one value per (page, group, rank) (`values`), the pinned staging pool (`staging`), "
        "the save and load state machines (`transfers`), `movers/` (host, CUDA, the tests' stand-in device)",
    ),
    Room(
        "gcache/integrations/vllm/events/",
        Product.ADAPTERS,
        "vLLM: GCache's L3 as vLLM KV events ([kv-events.md](kv-events.md)): what the connector's scheduler "
        "side announces (`source`), the wire (`wire`), its ZMQ publisher (`publisher`), their setup from the "
        "connector's settings (`setup`)",
    ),
    Room(
        "gcache/integrations/vllm/interval_stats.py",
        Product.ADAPTERS,
        "vLLM's connector-stats contract (`KVConnectorStats`, `ECConnectorStats`), kept once for both connectors",
    ),
    Room(
        "gcache/integrations/vllm/kv/",
        Product.ADAPTERS,
        "vLLM's KV connector `GCacheConnector`: its two halves (`scheduler_side`, `worker_side`), what they "
        "tell each other (`meta`), the plan of which pages load and save (`plan`), the KV cache groups, the "
        "keys, its settings and counters",
    ),
    Room(
        "gcache/integrations/vllm/ec/",
        Product.ADAPTERS,
        "vLLM's encoder-cache connector `GCacheECConnector`: its two halves, the value (a header plus the "
        "encoder output), keys, settings, counters",
    ),
    Room(
        "gcache/integrations/vllm/",
        Product.ADAPTERS,
        "vLLM's front door: `kv_connector_module_path` / `ec_connector_module_path` "
        "`gcache.integrations.vllm` names both connectors ([vllm.md](vllm.md))",
    ),
    Room(
        "gcache/integrations/sglang/",
        Product.ADAPTERS,
        "SGLang's HiCache L3 backend `GCacheHiCacheStorage` (`module_path` `gcache.integrations.sglang`) and "
        "its multimodal embedding store `GCacheEmbeddingStore`, with the `serve` wrapper that registers it "
        "([sglang.md](sglang.md))",
    ),
    Room(
        "gcache/integrations/",
        Product.ADAPTERS,
        "the engine adapters, one folder per engine, and `common/` for what they share",
    ),
    Room(
        "gcache/testing/",
        Product.TESTS,
        "fixtures the tests and benches share, never the product's: tiny models written offline "
        "(`vllm_models`, `vllm_mm`), engine runs (`vllm_chat`), SGLang's storage and embedding modules "
        "without its server (`sglang_modules`, `sglang_embedding`)",
    ),
    Room(
        "gcache/tools/plotting/",
        Product.TOOLING,
        "the benches' `--plot` charts (matplotlib, in the `bench` extra)",
    ),
    Room(
        "gcache/tools/devcluster/",
        Product.TOOLING,
        "every process launcher: local servers, masters, clusters (`gcache-cluster`), network namespaces, "
        "the seeded fault checker",
    ),
    Room(
        "gcache/tools/storebench/",
        Product.TOOLING,
        "the `gcache-bench` harness and its peers (Redis, Mooncake Store)",
    ),
    Room(
        "gcache/tools/",
        Product.TOOLING,
        "`demo` (`gcache-demo`), `train_mtp` (trains the shipped tiny hybrid + MTP weights; torch at "
        "training time only)",
    ),
]

NATIVE_FOLDERS: list[NativeFolder] = [
    NativeFolder(
        "common",
        "the arena (allocator, shared memory), checksums (`ChecksumKind`: XXH3 / xxh64 from libxxhash; "
        "`xxh3_copy`: XXH3 fused into a copy, AVX2 / AVX-512 chosen at run time), "
        "sha256, msgpack, the frame header, metrics, the key limits (`key_limits.h`), `GCACHE_ASSERT` "
        "(`assert.h`: on in debug builds)",
    ),
    NativeFolder(
        "core",
        "what the store and its eviction policies share: `entry.h` (an entry's life and second-chance "
        "states, the legal moves as methods), `owner.h` (`OwnerId`)",
    ),
    NativeFolder(
        "store",
        "`Store` (put / acquire / release / remove / flush) over its parts: `index` (key -> `Entry`), "
        "`memory_tier`, `disk_tier`, `owner_accounts` (tenant quotas), `warm_list`",
    ),
    NativeFolder(
        "eviction",
        "the `EvictionPolicy` contract (`policy.h`) and its policies: `chain` (+ tuner, queues), `s3fifo`, "
        "`lru`, `ghost`",
    ),
    NativeFolder("disk", "append-only segment files and their records"),
    NativeFolder(
        "server",
        "the data server: `server.cpp` (accept, read frame, check frame, dispatch; the handlers), `auth` "
        "(challenge-response), `io` (socket I/O), `limits`, `admission` (who gets a connection slot: the "
        "pre-auth budget, idle connections making room), `shm` and `shm_session` (the one-sided opcodes, "
        "leases, reservations), `connection.h` (per-connection state, the RAII guards)",
    ),
    NativeFolder(
        "client",
        "what the Python client runs natively: the client core (`core_framing`, `core_channel`, `core_tcp`, "
        "`core_shm`, `core_bindings`: one request frame per call, the GIL released), the ketama ring and the "
        "rendezvous scores, socket receive helpers, shared-memory copies (`shm_copy`)",
    ),
    NativeFolder("bindings", "the pybind11 module"),
]


def module_of(path: str) -> str:
    """The dotted room a row's path names: "gcache/router/ingest/" -> "gcache.router.ingest"."""
    if path == "gcache/__init__.py":
        return "gcache"
    if path.startswith("gcache/_native"):
        return "gcache._native"
    return path.removesuffix("/").removesuffix(".py").replace("/", ".")
