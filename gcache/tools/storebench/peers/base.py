"""The contract every store adapter meets, so all stores run identical workloads."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np


class Peer(ABC):
    """One connection-ish handle to a store, used by one benchmark worker.

    Values of a batch live back to back in one caller-owned numpy buffer:
    value i is buf[i*size:(i+1)*size]. Misses and failures are counted in the
    return values, never raised; exceptions mean the store is unusable.
    """

    name: str = "peer"

    def prepare_buffer(self, buf: np.ndarray) -> None:
        """Called once per buffer before it is used (zero-copy stores register it)."""

    @abstractmethod
    def put_from(self, keys: list[str], buf: np.ndarray, size: int) -> int:
        """Stores keys[i] -> value i; returns how many were stored (or already existed)."""

    @abstractmethod
    def get_into(self, keys: list[str], buf: np.ndarray, size: int) -> int:
        """Reads keys[i] into value slot i; returns how many hits of exactly `size` bytes."""

    @abstractmethod
    def exists(self, keys: list[str]) -> int:
        """Returns how many of `keys` exist, in one batched call."""

    @abstractmethod
    def get_one(self, key: str) -> bytes | None:
        """A single-key GET returning the value's bytes, or None on a miss."""

    @abstractmethod
    def remove(self, keys: list[str]) -> None:
        """Removes keys (used untimed, to keep each store's live data bounded)."""

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class PeerSpec:
    """Picklable recipe for opening a Peer in any thread or process."""

    kind: str  # "gcache" | "redis" | "mooncake"
    address: str = ""  # host:port of the store (mooncake: its master)
    options: dict = field(default_factory=dict)


_MODULES = {
    "gcache": "gcache.tools.storebench.peers.gcache_peer",
    "redis": "gcache.tools.storebench.peers.redis_peer",
    "mooncake": "gcache.tools.storebench.peers.mooncake_peer",
}


def open_peer(spec: PeerSpec) -> Peer:
    if spec.kind not in _MODULES:
        raise ValueError(f"unknown peer {spec.kind!r}: choose one of {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[spec.kind]).open_peer(spec)
