"""`gcache.Client(address)` picks its implementation here: "gcache://..." (or an
`initial_map`) is a ClusterClient, anything else a ServerClient. Kept out of the Client
contract (gcache.client.api) so the contract imports none of its implementations."""

from __future__ import annotations

from gcache.client.api import Client

CLUSTER_SCHEME = "gcache://"


def implementation_for(address, kwargs: dict) -> type[Client]:
    """The Client subclass that serves `address` (the cluster client loads grpc and the ring,
    so it is imported only when asked for)."""
    if (
        isinstance(address, str)
        and address.startswith(CLUSTER_SCHEME)
        or (address is None and kwargs.get("initial_map") is not None)
    ):
        from gcache.client.cluster_client import ClusterClient

        return ClusterClient
    from gcache.client.client import ServerClient

    return ServerClient


Client._implementation_for = staticmethod(implementation_for)
