"""State groups' pure parts (no vLLM needed): a hit needs every state at exactly the cut, the
boundary offers taken from vLLM's scheduler output, the page chain extended past the prompt,
and the key tag of a state group's values."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gcache.integrations.vllm.kv import plan
from gcache.integrations.vllm.kv.keys import prompt_page_hashes, salt_hash
from gcache.integrations.vllm.kv.state_groups import (
    StateOffer,
    StateSpec,
    boundary_offers,
    extend_hashes,
    state_tag,
)
from gcache.integrations.vllm.transfer.numpy_view import NumpyView
from gcache.integrations.vllm.transfer.page_runs import page_runs
from gcache.integrations.vllm.transfer.values import GroupValues


def test_a_hit_needs_every_state_group_at_exactly_the_cut():
    # Pages [0, 6) stored; states stored at cuts 2 and 4 (group 0) and 2, 5 (group 1).
    g0 = [False, True, False, True, False, False]  # present[i]: the state at cut i + 1
    g1 = [False, True, False, False, True, False]
    assert plan.best_cut(0, 6, [], [g0, g1]) == 2  # the only cut both groups hold
    assert plan.best_cut(0, 6, [], [g0]) == 4  # from the right
    assert plan.best_cut(0, 1, [], [g0]) == 0  # none at or before the full pages' end
    assert plan.best_cut(2, 6, [], [g0[2:]]) == 4  # counted from vLLM's own hit
    assert plan.best_cut(2, 3, [], [g0[2:]]) == 2  # no state at cut 3: vLLM's own hit stays
    # With a sliding-window group too: cut 4's tail page 3 is missing, cut 2's is there.
    assert plan.best_cut(0, 6, [(1, [True, True, True, False, True, True])], [g0]) == 2


def test_boundary_offers_keep_block_aligned_states_of_state_groups():
    out = SimpleNamespace(
        kv_connector_block_state=SimpleNamespace(
            boundary_state_offloads={
                "r1": [(0, 11, 256), (1, 12, 256), (2, 13, 256)],  # group 2: not a state group
                "r2": [(0, 21, 300)],  # a sub-block partial tail: left out
            }
        )
    )
    assert boundary_offers(out, {0, 1}, 128) == {"r1": [StateOffer(0, 11, 1), StateOffer(1, 12, 1)]}
    assert boundary_offers(SimpleNamespace(kv_connector_block_state=None), {0}, 128) == {}


def test_the_chain_goes_on_past_the_prompt_as_if_hashed_whole():
    tokens = list(range(1, 1001))
    prompt = prompt_page_hashes(tokens[:300], 128)  # 2 full pages
    hashes = list(prompt)
    assert extend_hashes(hashes, tokens, 7, 128)
    assert hashes == prompt_page_hashes(tokens[:896], 128)
    assert not extend_hashes(hashes, tokens[:900], 8, 128)  # too few tokens: unchanged
    assert len(hashes) == 7
    salted: list[str] = []  # a prompt shorter than a page, with a cache salt: the chain's seed
    assert extend_hashes(salted, tokens, 2, 128, salt_hash("s"))
    assert salted == prompt_page_hashes(tokens[:256], 128, "s") != prompt_page_hashes(tokens[:256], 128)


def _values(content_bytes: int, padded: int) -> GroupValues:
    raw = np.zeros((4, padded), dtype=np.int8)[:, :content_bytes].reshape(4, 1, 1, content_bytes)
    return GroupValues([page_runs(NumpyView(raw), 4)], 1 << 20)


def test_state_values_store_unpadded_bytes_and_tags_name_the_layout():
    values = _values(10112, 65536)  # vLLM pads a state page up to the attention page
    assert values.value_bytes == 10112
    spec = StateSpec("mamba2", ((3, 160), (4, 32, 16)), ("float32", "float32"), "default", "align", 0)
    layers = [(0, [(0, 10112)])]
    tag = state_tag(spec, values, layers)
    assert tag.startswith("mamba2-b10112n1-") and tag.endswith("s1")
    for other in (
        spec._replace(dtypes=("float32", "bfloat16")),
        spec._replace(conv_layout="DS"),
        spec._replace(shapes=((160, 3), (4, 32, 16))),
    ):
        assert state_tag(other, values, layers) != tag


def test_state_settings_are_read_and_bad_ones_refused():
    import pytest

    from gcache.integrations.vllm.kv.settings import ConnectorSettings, SettingsError

    url = {"gcache_url": "127.0.0.1:7600"}
    s = ConnectorSettings.from_extra_config({**url, "gcache_state_admission": "ends", "gcache_state_boundaries_max": 3})
    assert (s.state_admission, s.state_boundaries_max) == ("ends", 3)
    with pytest.raises(SettingsError, match="gcache_state_admission"):
        ConnectorSettings.from_extra_config({**url, "gcache_state_admission": "some"})
