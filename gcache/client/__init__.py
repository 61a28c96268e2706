"""The GCache Python client: `gcache.Client("host:port")`."""
from gcache.client.client import Client

__all__ = ["Client"]
