"""State groups: vLLM's MambaSpec groups (Mamba, Mamba2, gated delta net, ...) as the connector
serves them.

A recurrent layer's state is the sliding-window idea taken to its end: resuming at boundary b
needs the attention pages of [0, b) and every state group's state *exactly at* b. So a state
is one value per (prefix hash at b, state group, TP rank) holding every layer of the group at
b, stored as the layer's unpadded bytes (vLLM hands a state layer to a connector as a raw
int8 `[blocks, 1, 1, unpadded bytes]` view over a padded page). In the connector's page
numbering the state at b is "page" b / block_size - 1 of its group, keyed by the page hash of
the prefix [0, b): the same chain as the attention pages.

vLLM 0.32 runs such groups in `mamba_cache_mode="align"` (prefix caching on): one block table
slot per block, slot i holding the state after (i + 1) * block_size tokens, finished slots
nulled (the table is not append-only) and one running slot the kernel reads. Hence:
- saves come only from `scheduler_output.kv_connector_block_state.boundary_state_offloads`
  (group, block, boundary tokens), copied in the step that offers them; never from the
  positional table;
- a load writes the state into the hit's boundary slot (table index n - 1) and must land
  before the request's first forward, whose `preprocess_mamba` copies that slot into the
  running slot: state groups always load between steps (asynchronously);
- the key's tag holds everything that changes the bytes (`StateSpec`: state kind, shapes,
  dtypes, the conv-state layout, and the worker's byte runs), beside the model and TP rank.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from gcache.integrations.vllm.transfer.values import GroupValues

ALIGN = "align"  # the only mamba_cache_mode whose boundary states can be cached
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


class StateSpec(NamedTuple):
    """What a state group's bytes depend on, beyond the model, the TP rank and size."""

    state_kind: str  # vLLM's mamba_type's name, lower case (mamba1, mamba2, gdn_attn, ...)
    shapes: tuple[tuple[int, ...], ...]  # per state tensor (conv state, ssm state, ...)
    dtypes: tuple[str, ...]
    conv_layout: str  # VLLM_SSM_CONV_STATE_LAYOUT (SD / DS), "default" when unset
    cache_mode: str  # vLLM's mamba_cache_mode: "align" serves hits; "none" has no boundary states
    speculative_blocks: int

    def describe(self) -> str:
        return repr((self.state_kind, self.shapes, self.dtypes, self.conv_layout, self.speculative_blocks))


def state_spec_of(spec: Any) -> StateSpec:  # spec: vllm.v1.kv_cache_interface.MambaSpec
    import vllm.envs as envs

    kind = getattr(spec.mamba_type, "name", spec.mamba_type)  # an enum member: MAMBA2, GDN_ATTN, ...
    return StateSpec(
        state_kind=_BAD.sub("", str(kind)).lower() or "state",
        shapes=tuple(tuple(int(n) for n in s) for s in spec.shapes),
        dtypes=tuple(str(d).replace("torch.", "") for d in spec.dtypes),
        conv_layout=str(getattr(envs, "VLLM_SSM_CONV_STATE_LAYOUT", None) or "default"),
        cache_mode=str(spec.mamba_cache_mode),
        speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
    )


def state_tag(state: StateSpec, values: GroupValues, layers: list[Any]) -> str:
    """The key tag of a state group's values: the state kind, bytes per value, layer count and a
    digest of the StateSpec and the layers' byte runs (another dtype, shape or conv layout is
    another tag, so engines never read each other's states)."""
    digest = hashlib.sha256(f"{state.describe()}|{layers!r}".encode()).hexdigest()[:12]
    return f"{state.state_kind}-b{values.value_bytes}n{len(layers)}-{digest}s{values.segments}"


def why_not_served(states: Sequence[StateSpec]) -> str | None:
    """Why these state groups cannot be cached (None: they can)."""
    if any(s.cache_mode != ALIGN for s in states):
        return "mamba_cache_mode is not 'align' (prefix caching off): vLLM keeps no boundary states"
    if any(s.speculative_blocks for s in states):
        return "speculative decoding with state groups is not served yet (its running slots move)"
    return None


ADMISSIONS = ("offered", "ends")


def admitted(offers: list[StateOffer], rule: str, prompt_len: int, block_size: int, branch: int) -> list[StateOffer]:
    """The offers a request saves. "offered": all. "ends" (Marconi's placement, as far as vLLM
    offers): the prompt's last full boundary, boundaries reached while decoding (a follow-up
    turn resumes at the answer), and the branch point (`branch`: the end of the stored prefix
    the lookup found, a prefix seen before); a long prompt's other chunk ends are dropped."""
    if rule == "offered":
        return offers
    prompt_end = prompt_len // block_size
    return [o for o in offers if o.page + 1 in (prompt_end, branch) or (o.page + 1) * block_size > prompt_len]


class StateOffer(NamedTuple):
    group: int
    block_id: int  # the exact block vLLM offers (never resolved positionally)
    page: int  # the state is after (page + 1) * block_size tokens


def boundary_offers(out: Any, state_groups: set[int], block_size: int) -> dict[str, list[StateOffer]]:
    """This step's block-aligned boundary states of state groups, per request (out: vLLM's
    SchedulerOutput). Sub-block partial tails are left out: hits land on block boundaries."""
    block_state = getattr(out, "kv_connector_block_state", None)
    offers = getattr(block_state, "boundary_state_offloads", None) or {}
    found: dict[str, list[StateOffer]] = {}
    for req_id, items in offers.items():
        for group, block_id, tokens in items:
            if group in state_groups and tokens > 0 and tokens % block_size == 0:
                found.setdefault(req_id, []).append(StateOffer(group, block_id, tokens // block_size - 1))
    return found


def extend_hashes(
    hashes: list[str],
    tokens: Sequence[int],
    pages: int,
    block_size: int,
    seed: str | None = None,
    rehash: Any | None = None,
) -> bool:
    """Extends a request's page hashes to `pages` pages over its tokens so far (prompt and
    output: the chain goes on past the prompt, so a continuation's lookup finds the states its
    earlier answer reached). `rehash(tokens)`: the whole chain afresh (prompts with multimodal
    items); else the chain continues from its last hash (from `seed`, the cache salt's, when empty). False when the tokens are too few."""
    from gcache.wire.keys import page_hashes_array

    if pages <= len(hashes):
        return True
    if len(tokens) < pages * block_size:
        return False
    if rehash is not None:
        hashes[:] = rehash(list(tokens[: pages * block_size]))
        return len(hashes) >= pages
    start = len(hashes) * block_size
    hashes += page_hashes_array(list(tokens[start : pages * block_size]), block_size, hashes[-1] if hashes else seed)
    return True
