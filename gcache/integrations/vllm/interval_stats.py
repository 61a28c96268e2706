"""vLLM's connector-stats contract (KVConnectorStats, ECConnectorStats: a `data` dict that
workers send and the logger sums) kept once for both connectors: `data` holds counter changes
over an interval, so aggregating workers or intervals adds them up. Imports no vLLM."""

from __future__ import annotations

from typing import Any, Protocol, Self


class HasData(Protocol):
    data: dict[str, Any]


class SummedIntervalStats:
    """Mixed in before vLLM's stats base class, which declares `data` and leaves these methods
    unimplemented: `@dataclass class S(SummedIntervalStats, KVConnectorStats)`."""

    data: dict[str, Any]

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: HasData) -> Self:
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data
