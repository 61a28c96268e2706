"""The PUT_BATCH "worth" field (docs/protocol.md, "Value worth"): per value, what it is
and what recomputing it would cost, so a node weighs what a value saves per byte when it
evicts. Optional and versioned: a node from before it skips the field (today's order); a
node that speaks it refuses a malformed one with BAD_FRAME and stores nothing.

On the wire (plain msgpack, in the PUT_BATCH metadata map beside "keys"):
    "worth": {"v": 1, "kind": [kind per key], "cost": [cost per key]}
kind: ValueKind; cost: the prefill tokens the value spares an engine (0: not said, the
value is ordered as if it carried no field). The native client passes the same map.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from gcache.errors import InvalidArgumentError

WORTH_VERSION = 1
COST_MAX = (1 << 64) - 1


class ValueKind(IntEnum):
    """What a value is. The numbers are the contract: never renumber."""

    OTHER = 0
    ATTENTION_PAGE = 1  # one block's attention KV
    STATE_CHECKPOINT = 2  # a recurrent (Mamba / linear-attention) state at a block boundary


class Worth(NamedTuple):
    kind: ValueKind
    cost: int  # prefill tokens the value spares (>= 0)


def check_worth(worth: Sequence[Worth], n: int) -> None:
    """InvalidArgumentError unless `worth` holds one valid (kind, cost) per key."""
    if len(worth) != n:
        raise InvalidArgumentError(f"worth: {n} keys but {len(worth)} worth entries (one per key)")
    for i, (kind, cost) in enumerate(worth):
        if not isinstance(cost, int) or isinstance(cost, bool) or not 0 <= cost <= COST_MAX:
            raise InvalidArgumentError(f"worth[{i}]: cost must be an integer in [0, 2**64), got {cost!r}")
        if kind not in ValueKind._value2member_map_:
            raise InvalidArgumentError(f"worth[{i}]: unknown value kind {kind!r}; known: {[int(k) for k in ValueKind]}")


def worth_field(worth: Sequence[Worth]) -> dict[str, Any]:
    """The "worth" map for the values of one PUT_BATCH, in key order."""
    return {"v": WORTH_VERSION, "kind": [int(w[0]) for w in worth], "cost": [int(w[1]) for w in worth]}
