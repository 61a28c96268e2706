"""The attention kind of a layer, a KV pool and a KV cache group: one enum for the worker's
layer pattern and pools, the store's key words and the engine adapters' groups.

A StrEnum whose values are the strings the wire keys, Redis layouts and handoff records have
always carried ("full", "swa"): a member equals and hashes as its value, so stored keys and
records do not change.
"""

from __future__ import annotations

import enum


class AttentionKind(enum.StrEnum):
    FULL = "full"  # attends to every earlier position: keeps KV for every page
    SWA = "swa"  # sliding window: needs KV only for the window before a position
    STATE = "state"  # a recurrent layer's state (Mamba, gated delta net): one value per boundary
