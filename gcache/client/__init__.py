"""The GCache Python client: `gcache.Client("host:port")`, or a whole cluster with
`gcache.Client("gcache://master:port,...")` (a ClusterClient)."""
from gcache.client.client import Client

__all__ = ["Client", "ClusterClient"]


def __getattr__(name):
    # Lazy: the cluster client pulls in grpc and the placement ring, which a
    # single-node user never needs.
    if name == "ClusterClient":
        from gcache.client.cluster_client import ClusterClient
        return ClusterClient
    raise AttributeError(f"module 'gcache.client' has no attribute {name!r}")
