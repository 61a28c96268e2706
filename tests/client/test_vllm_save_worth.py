"""The vLLM connector tells the node what a saved value is worth (the PUT's "worth",
docs/protocol.md "Value worth"): a state checkpoint its prefix's tokens, an attention page
its block's, each segment its share. Through the real Transfers and a real gcache-server;
the node's gauges say what it was told."""

from __future__ import annotations

from gcache.common.attention import AttentionKind
from gcache.integrations.vllm.kv.groups import Group
from gcache.integrations.vllm.kv.settings import ConnectorSettings
from gcache.integrations.vllm.kv.worker_side import value_worth
from gcache.wire.worth import ValueKind, Worth
from tests.client.test_vllm_transfers import Rig


def test_a_state_is_worth_its_prefix_and_a_page_its_block():
    state = Group(0, AttentionKind.STATE, ("m",), (0,), 128, 0)
    full = Group(1, AttentionKind.FULL, ("a",), (1,), 128, 0)
    assert value_worth(state, 640) == Worth(ValueKind.STATE_CHECKPOINT, 640)
    assert value_worth(full, 640) == Worth(ValueKind.ATTENTION_PAGE, 128)


def test_saves_carry_their_worth_to_the_node(server):
    rig = Rig(server, value_bytes_max=256)  # a value of 768 bytes in segments
    try:
        assert rig.values.segments > 1  # each segment gets its share
        told = rig.page(3, "state")._replace(worth=Worth(ValueKind.STATE_CHECKPOINT, 4096))
        page = rig.page(4, "page")._replace(worth=Worth(ValueKind.ATTENTION_PAGE, 16))
        silent = rig.page(5, "silent")
        rig.t.save([told, page, silent], ["r1"] * 3, reused_next_step=False)
        rig.wait_saved()
        gauges = rig.client.stats()["gauges"]
        value = rig.values.value_bytes
        assert gauges["memory_worth_state_bytes"] >= value  # block-rounded in the arena
        assert gauges["memory_worth_page_bytes"] >= value
        assert gauges["memory_worth_values"] == 2 * rig.values.segments
        assert rig.stored("silent") is not None and rig.stored("state") is not None
    finally:
        rig.close()


def test_the_connector_says_worth_only_when_asked():
    url = {"gcache_url": "127.0.0.1:1"}
    assert ConnectorSettings.from_extra_config(url).put_worth is False
    assert ConnectorSettings.from_extra_config({**url, "gcache_put_worth": True}).put_worth is True
