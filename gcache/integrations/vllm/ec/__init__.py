"""GCache as vLLM's encoder-cache connector (vLLM 0.32, `ECConnectorBase`): encoder outputs
of multimodal items shared by content across engines.

    ECTransferConfig(ec_connector="GCacheECConnector",
                     ec_connector_module_path="gcache.integrations.vllm",
                     ec_role="ec_both",
                     ec_connector_extra_config={"gcache_url": "127.0.0.1:7600"})

connector (the class vLLM loads), settings (extra_config), keys (one key per item), value (the
value's header), scheduler_side (batched reads before a request is scheduled), worker_side
(into vLLM's encoder cache; writes after the encoder), stats. keys, value and settings import
neither vLLM nor torch.
"""

__all__ = ["GCacheECConnector"]


def __getattr__(name: str) -> type:
    if name == "GCacheECConnector":
        from gcache.integrations.vllm.ec.connector import GCacheECConnector

        return GCacheECConnector
    raise AttributeError(f"module 'gcache.integrations.vllm.ec' has no attribute {name!r}")
