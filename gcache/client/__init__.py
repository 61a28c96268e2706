"""The GCache Python client: `gcache.Client("host:port")` (a ServerClient), or a whole
cluster with `gcache.Client("gcache://master:port,...")` (a ClusterClient); both are
gcache.Client (the contract: gcache.client.api; the choice: gcache.client.factory)."""

from gcache.client import factory as _factory  # noqa: F401  (installs Client's implementation choice)
from gcache.client.api import Client

__all__ = ["Client", "ClusterClient", "ServerClient"]


def __getattr__(name):
    # Lazy: the cluster client pulls in grpc and the placement ring, which a
    # single-node user never needs.
    if name == "ClusterClient":
        from gcache.client.cluster_client import ClusterClient

        return ClusterClient
    if name == "ServerClient":
        from gcache.client.client import ServerClient

        return ServerClient
    raise AttributeError(f"module 'gcache.client' has no attribute {name!r}")
