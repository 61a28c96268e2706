"""GCache through gcache.Client's zero-copy calls (batch_put_from / batch_get_into)."""

from __future__ import annotations

from gcache.tools.storebench.peers.base import Peer, PeerSpec

CLIENT_TIMEOUT_S = 60.0  # a 64 x 16 MiB batch on a loaded 2-core box takes seconds


class GCachePeer(Peer):
    name = "gcache"

    def __init__(self, address: str, token: str | None = None, transport: str = "auto"):
        import gcache

        self.client = gcache.Client(address, timeout_s=CLIENT_TIMEOUT_S, token=token, transport=transport)
        self._layouts: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def _layout(self, n: int, size: int) -> tuple[list[int], list[int]]:
        """(sizes, offsets) of n back-to-back values, built once per shape."""
        layout = self._layouts.get((n, size))
        if layout is None:
            layout = self._layouts[(n, size)] = ([size] * n, [i * size for i in range(n)])
        return layout

    def put_from(self, keys, buf, size):
        sizes, offsets = self._layout(len(keys), size)
        return sum(1 for ok in self.client.batch_put_from(keys, buf, sizes, offsets) if ok)

    def get_into(self, keys, buf, size):
        sizes, offsets = self._layout(len(keys), size)
        return sum(1 for n in self.client.batch_get_into(keys, buf, sizes, offsets) if n == size)

    def exists(self, keys):
        return sum(1 for present in self.client.batch_is_exist(keys) if present)

    def get_one(self, key):
        return self.client.get(key)

    def remove(self, keys):
        if keys:
            self.client.batch_remove(keys)

    def close(self):
        self.client.close()


def open_peer(spec: PeerSpec) -> Peer:
    return GCachePeer(spec.address, spec.options.get("token"), spec.options.get("transport", "auto"))


def transport_unavailable_reason(address: str, token: str | None, transport: str) -> str | None:
    """None when a client can use `transport` to reach `address`; else why not (one line)."""
    import gcache
    from gcache import errors

    try:
        client = gcache.Client(address, timeout_s=CLIENT_TIMEOUT_S, token=token, transport=transport)
    except errors.TransportUnavailableError as exc:
        return " ".join(str(exc).split())
    used = client.transport
    client.close()
    return None if used == transport else f"the client picked {used!r} instead"
