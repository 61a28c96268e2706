"""The cache tiers by name, as the worker reports them and the router credits them."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    """A level of the worker's cache hierarchy. The values are the keys of
    usage.cached_tokens_by_tier, of the router's explain output and a host page's origin."""

    L1 = "l1"  # device pools, the SWA radix tree
    L2 = "l2"  # the worker's host pool
    L3 = "l3"  # GCache


TIERS = tuple(Tier)
