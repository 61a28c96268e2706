"""GCache: a distributed L3 KV-cache store for LLM inference."""

__version__ = "0.1.0"

from gcache.errors import (  # noqa: E402
    BufferTooSmallError,
    ChecksumMismatchError,
    GCacheError,
    KeyInvalidError,
    ProtocolError,
    ServerBusyError,
    ValueTooLargeError,
)

__all__ = [
    "Client",
    "ClusterClient",
    "GCacheError",
    "BufferTooSmallError",
    "ChecksumMismatchError",
    "KeyInvalidError",
    "ProtocolError",
    "ServerBusyError",
    "ValueTooLargeError",
]


def __getattr__(name):
    # Lazy, so `import gcache.<anything>` does not load the client (numpy, the native module).
    if name == "Client":
        from gcache.client import Client

        return Client
    if name == "ClusterClient":
        from gcache.client import ClusterClient

        return ClusterClient
    raise AttributeError(f"module 'gcache' has no attribute {name!r}")
