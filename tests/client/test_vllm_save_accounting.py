"""The counters a soak reconciles with the node's (bench/vllm/soak_counters.py), against a real
gcache-server: GuardedStore's per-value tally of its puts and gets (`wire`) equals the node's
own counters, a call that failed on the way counts as "unanswered" and one made while the
store is suspect as "unsent"; the connector's stats file always holds a whole record with the
current totals, and its last write comes at close."""

from __future__ import annotations

import json
import logging

import pytest

import gcache
from bench.vllm.soak_counters import KEYS, reconcile
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.common.stats_file import StatsFile
from gcache.integrations.vllm.kv.stats import ConnectorStats

log = logging.getLogger("test")
VALUE = 4096


def node_counters(server) -> dict[str, int]:
    with gcache.Client(server.address, transport="tcp") as c:
        counters: dict[str, int] = c.stats()["counters"]
    return counters


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_the_wire_tally_equals_the_nodes_counters(server_factory, transport):
    """Over both ways a put travels on one host: PUT_BATCH (tcp) and RESERVE + COMMIT (shm),
    each value counted once by the node, whatever became of it."""
    server = server_factory(memory="8MiB", disk="0")
    client = gcache.Client(server.address, transport=transport, timeout_s=2.0, retries=0)
    store = GuardedStore(client, 60.0, ConnectorStats(), log)
    values = [bytes([i + 1]) * VALUE for i in range(4)]
    keys = [f"acct-{i}".encode() for i in range(4)]
    too_large = bytes(9 << 20)  # more than the node's whole arena: refused, the batch's others stored
    assert store.put_from(keys[:3], values[:3]) == [True] * 3
    assert store.put_from([keys[0], keys[3], b"acct-big"], [values[0], values[3], too_large]) == [True, True, False]
    buffers = [bytearray(VALUE) for _ in range(3)]
    got = store.get_into([keys[1], b"acct-absent", keys[3]], buffers)
    assert got == [VALUE, None, VALUE] and bytes(buffers[2]) == values[3]

    node = node_counters(server)
    wire = store.wire.snapshot()
    assert wire["put_values_answered_yes"] == node["puts_stored"] + node["puts_exists"] == 5
    assert wire["put_values_answered_no"] == node["puts_no_space"] + node["puts_too_large"] == 1
    assert wire["get_values_answered_yes"] == node["hits_memory"] == 2
    assert wire["get_values_answered_no"] == node["misses"] == 1

    server.stop()
    assert store.put_from(keys[:2], values[:2]) == [False, False]  # failed on the way
    assert store.get_into(keys[:1], buffers[:1]) == [None]  # the store is suspect now: not sent
    wire = store.wire.snapshot()
    assert (wire["put_values_unanswered"], wire["put_values_unsent"]) == (2, 0)
    assert (wire["get_values_unanswered"], wire["get_values_unsent"]) == (0, 1)
    client.close()


def test_the_stats_file_holds_the_current_totals_and_is_written_at_close(tmp_path):
    stats = ConnectorStats()
    path = tmp_path / "stats" / "worker-0.json"
    f = StatsFile(path, stats.snapshot, interval_s=3600.0, log=log)  # only explicit writes here
    first = json.loads(path.read_text())
    assert first["counters"]["values_saved"] == 0 and first["seq"] == 1
    stats.count("values_saved", 7)
    f.close()
    last = json.loads(path.read_text())
    assert last["counters"]["values_saved"] == 7 and last["seq"] > first["seq"]
    assert [p.name for p in path.parent.iterdir()] == ["worker-0.json"]  # no temporary file left


def _engine(**counters: int) -> list[dict[str, dict[str, float]]]:
    worker = dict.fromkeys(KEYS, 0.0)
    worker.update({k: float(v) for k, v in counters.items()})
    return [{"scheduler": {}, "worker-0": worker}]


def test_reconcile_accepts_exact_totals_and_names_what_does_not_add_up():
    engines = _engine(
        save_values_offered=10,
        values_saved=6,
        values_skipped_existing=1,
        values_save_failed=2,
        save_values_dropped=1,
        put_values_answered_yes=6,
        put_values_answered_no=2,
        values_loaded=3,
        get_values_answered_yes=3,
    )
    node = dict(puts_stored=5, puts_exists=1, puts_no_space=2, hits_memory=3)
    figures, problems = reconcile(engines, node)
    assert problems == [] and figures["saved_vs_node"] == [6, 6]

    _, problems = reconcile(engines, dict(node, puts_stored=6))  # one put the connectors never saw
    assert len(problems) == 1 and "the node took 7" in problems[0]

    lost = _engine(**{**engines[0]["worker-0"], "values_save_failed": 3, "put_values_unanswered": 1})
    lost[0]["worker-0"]["save_values_offered"] = 11
    _, problems = reconcile(lost, dict(node, puts_stored=6))  # it may have landed: it was unanswered
    assert problems == []
