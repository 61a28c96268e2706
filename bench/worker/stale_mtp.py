"""The peers' MTP baselines for bench.worker.mtp_acceptance: engines that keep no MTP state
with a prefix. Their MTP blocks read the window's KV slots as if valid, and the slots hold
what the last request left there (another request's MTP KV; zeros on a fresh worker).
Never masked: such an engine does not know which slots are stale.

  stale         MTPPrefix.NONE, the window read from stale slots (the production report's prefill);
  stale-prefix  MTPPrefix.PREFILL, a cached prefix's window read from stale slots (SGLang's
                draft pool on a HiCache hit before sglang#21125, vLLM's offload connector).

A benchmark strategy, not a worker mode: Engine(..., decoding=stale_decoding(K, mode)).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gcache.worker.engine.decoding import DecodingContext, DecodingStrategy
from gcache.worker.engine.request import Request
from gcache.worker.engine.speculative import MTPPrefix, MTPSpeculator
from gcache.worker.model.mtp import MTPState

STALE_MODES = {"stale": MTPPrefix.NONE, "stale-prefix": MTPPrefix.PREFILL}


class StaleSlotsSpeculator(MTPSpeculator):
    """MTPSpeculator whose blank states read the ring the last request left, unmasked."""

    def __init__(self, ctx: DecodingContext, depths: int, mode: str) -> None:
        if mode not in STALE_MODES:
            raise ValueError(f"stale mode must be one of {tuple(STALE_MODES)}, got {mode!r}")
        super().__init__(ctx, depths, STALE_MODES[mode])
        self.mode = mode
        self.slots: tuple[np.ndarray, np.ndarray] | None = None  # (k, v) rings the last request left

    def blank_state(self, r: Request, start: int) -> MTPState:
        st = self.head.new_state(start, r.kv)
        if start > 0:
            if self.slots is not None:
                st.k[...], st.v[...] = self.slots
            st.first = max(0, start - self.head.config.window + 1)
        return st

    def forget(self, r: Request) -> None:
        if r.mtp is not None:  # the slots keep their bytes for the next request
            self.slots = (r.mtp.k, r.mtp.v)
        super().forget(r)


def stale_decoding(depths: int, mode: str) -> Callable[[DecodingContext], DecodingStrategy]:
    """Engine(decoding=...) for a stale baseline with `depths` MTP drafts."""
    if mode not in STALE_MODES:
        raise ValueError(f"stale mode must be one of {tuple(STALE_MODES)}, got {mode!r}")
    return lambda ctx: StaleSlotsSpeculator(ctx, depths, mode)
