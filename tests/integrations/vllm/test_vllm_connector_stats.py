"""The connectors' stats objects as vLLM 0.32 handles them: built by the connector class from a
dict (vLLM's build_*_connector_stats), pickled from worker to logger, summed across workers and
intervals (aggregate), reduced for the log line, reset. Both connectors share one implementation
(gcache.integrations.vllm.interval_stats) over vLLM's two base classes."""

from __future__ import annotations

import pickle

import pytest
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from gcache.integrations.vllm.ec.connector import GCacheECConnector
from gcache.integrations.vllm.kv.connector import GCacheConnector

BUILDERS = [
    pytest.param(GCacheConnector.build_kv_connector_stats, KVConnectorStats, id="kv"),
    pytest.param(GCacheECConnector.build_ec_connector_stats, ECConnectorStats, id="ec"),
]


@pytest.mark.parametrize(("build", "base"), BUILDERS)
def test_stats_sum_over_workers_and_intervals(build, base):
    first = build({"values_saved": 3, "save_s": 0.25})
    assert isinstance(first, base)
    second = pickle.loads(pickle.dumps(build({"values_saved": 4, "lookups": 1})))  # as a worker sends it
    assert second.aggregate(first) is second  # vLLM keeps the returned object
    assert second.reduce() == {"values_saved": 7, "lookups": 1, "save_s": 0.25}
    assert first.reduce() == {"values_saved": 3, "save_s": 0.25}  # the other side is untouched
    reduced = second.reduce()
    reduced["values_saved"] = 0
    assert second.data["values_saved"] == 7  # reduce() hands out a copy
    assert not second.is_empty()
    second.reset()
    assert second.is_empty() and second.reduce() == {}


@pytest.mark.parametrize(("build", "base"), BUILDERS)
def test_stats_from_nothing_are_empty(build, base):
    assert build().is_empty() and build(None).reduce() == {}
    assert build({}).aggregate(build({"items_saved": 2})).reduce() == {"items_saved": 2}
