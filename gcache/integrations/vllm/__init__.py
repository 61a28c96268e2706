"""GCache as vLLM's KV connector (vLLM 0.32, `KVConnectorBase_V1` + `SupportsHMA`):

    KVTransferConfig(kv_connector="GCacheConnector",
                     kv_connector_module_path="gcache.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"gcache_url": "127.0.0.1:7600"})

Its rooms, each with one job:
- kv/: the KV connector itself: connector (the class vLLM loads), settings (extra_config),
  groups (vLLM's KV cache groups as full / sliding-window pools), keys (value keys and their
  layout tag), plan (which pages to load and save: pure functions), scheduler_side /
  worker_side (the two halves), meta (what they tell each other), stats.
- transfer/: moving pages: page_runs (where a block lies in vLLM's layouts), values (a group's
  layers per block as one value), staging (host slots), transfers (the save and load state
  machines), movers/ (host, stand-in and CUDA copies).
- events/: GCache's L3 as vLLM KV events (docs/kv-events.md).
- ec/: GCacheECConnector, vLLM's encoder-cache connector (ec_transfer_config, the same module
  path with ec_connector="GCacheECConnector").
- interval_stats: vLLM's connector-stats contract, kept once for both connectors.
The tests' and benches' tiny models and engine runs live in gcache.testing, not here.
"""

__all__ = ["GCacheConnector", "GCacheECConnector"]


def __getattr__(name: str) -> type:
    # Lazy: the connector imports vllm and torch; settings, keys and plan do not, so they stay
    # importable (and testable) without vLLM installed.
    if name == "GCacheConnector":
        from gcache.integrations.vllm.kv.connector import GCacheConnector

        return GCacheConnector
    if name == "GCacheECConnector":
        from gcache.integrations.vllm.ec.connector import GCacheECConnector

        return GCacheECConnector
    raise AttributeError(f"module 'gcache.integrations.vllm' has no attribute {name!r}")
