"""The connector's sync/async choice per load (kv/load_choice.py) and its settings: from the
load's bytes at the measured rate, the engine's recent step time and whether others run."""

from __future__ import annotations

import pytest

from gcache.integrations.vllm.kv.load_choice import FETCH_PRIOR_BPS, LoadCosts, choose_async
from gcache.integrations.vllm.kv.settings import ConnectorSettings, SettingsError

URL = {"gcache_url": "127.0.0.1:7600"}


def test_an_idle_engine_loads_in_the_step_unless_the_load_is_too_long():
    assert not choose_async(0.2, 0.0, others_running=False, fraction=0.5, idle_max_s=0.25)
    assert choose_async(0.3, 0.0, others_running=False, fraction=0.5, idle_max_s=0.25)


def test_a_busy_engine_loads_in_the_step_only_when_it_adds_little_to_the_others_step():
    assert not choose_async(0.004, 0.010, others_running=True, fraction=0.5, idle_max_s=0.25)
    assert choose_async(0.006, 0.010, others_running=True, fraction=0.5, idle_max_s=0.25)
    # no step measured yet while others run: between steps (never slows them unmeasured)
    assert choose_async(0.001, 0.0, others_running=True, fraction=0.5, idle_max_s=0.25)


def test_costs_follow_the_measured_rates():
    costs = LoadCosts()
    assert costs.load_seconds(FETCH_PRIOR_BPS, staged=False) == pytest.approx(1.0)
    costs.observe_load(8e9, 1.0, staged=False)  # the first observation replaces the prior
    assert costs.load_seconds(8e9, staged=False) == pytest.approx(1.0)
    costs.observe_load(4e9, 1.0, staged=False)  # then a moving average
    assert 1.0 < costs.load_seconds(8e9, staged=False) < 2.0
    staged_before = costs.load_seconds(1e9, staged=True)
    costs.observe_load(0, 0.5, staged=True)  # nothing moved: no observation
    assert costs.load_seconds(1e9, staged=True) == staged_before
    costs.observe_step(0.02)
    costs.observe_step(0.04)
    assert 0.02 < costs.recent_step_s() < 0.04


def test_a_small_load_goes_in_the_step_and_a_large_one_between_steps_when_busy():
    costs = LoadCosts()
    costs.observe_load(2e9, 1.0, staged=False)  # 2 GB/s
    costs.observe_step(0.020)
    small = costs.load_seconds(8 << 20, staged=False)  # 4 ms
    large = costs.load_seconds(64 << 20, staged=False)  # 34 ms
    assert not choose_async(small, costs.recent_step_s(), True, 0.5, 0.25)
    assert choose_async(large, costs.recent_step_s(), True, 0.5, 0.25)
    assert not choose_async(large, costs.recent_step_s(), False, 0.5, 0.25)


def test_settings_default_to_the_measured_choice_and_prefetch_on():
    s = ConnectorSettings.from_extra_config(URL)
    assert s.async_load_min_tokens is None and s.prefetch and s.prefetch_mib == 256
    fixed = ConnectorSettings.from_extra_config({**URL, "gcache_async_load_min_tokens": 512})
    assert fixed.async_load_min_tokens == 512
    tuned = ConnectorSettings.from_extra_config(
        {**URL, "gcache_load_step_fraction": 0.25, "gcache_prefetch": False, "gcache_prefetch_wait_s": 0.5}
    )
    assert tuned.load_step_fraction == 0.25 and not tuned.prefetch and tuned.prefetch_wait_s == 0.5
    assert ConnectorSettings.from_extra_config(URL).load_last_page
    assert not ConnectorSettings.from_extra_config({**URL, "gcache_load_last_page": False}).load_last_page


@pytest.mark.parametrize(
    "key,value",
    [
        ("gcache_load_step_fraction", -1),
        ("gcache_prefetch", "yes"),
        ("gcache_prefetch_mib", 0),
        ("gcache_prefetch_requests_max", 0),
        ("gcache_sync_load_max_s", "1"),
        ("gcache_idle_wait_s", 5),
        ("gcache_async_load_min_tokens", -1),
    ],
)
def test_bad_settings_are_refused(key, value):
    with pytest.raises(SettingsError, match=key):
        ConnectorSettings.from_extra_config({**URL, key: value})


def test_the_async_tax_counts_steps_parked_and_the_others_step_times():
    from gcache.integrations.vllm.kv.async_tax import AsyncTax
    from gcache.integrations.vllm.kv.stats import ConnectorStats

    stats, costs = ConnectorStats(), LoadCosts()
    tax = AsyncTax(stats, costs)
    tax.step({"a"}, set(), now=0.0)  # step 1: "a" decodes
    assert tax.others_running("r") and not tax.others_running("a")
    tax.park("r", now=0.5)  # "r" loads between steps, planned while step 2 is scheduled
    tax.step({"a"}, set(), now=1.0)  # step 2 (step 1 took 1.0, no load)
    tax.step({"a"}, set(), now=3.0)  # step 3 (step 2 took 2.0, "r" loading)
    tax.step({"a", "r"}, set(), now=4.0)  # step 4 runs "r" (step 3 took 1.0, "r" loading)
    tax.scheduled("r", now=4.0)
    c = stats.snapshot()
    assert (c["remote_waits"], c["remote_wait_s"], c["remote_wait_steps"]) == (1, 3.5, 2)
    assert c["remote_waits_one_step"] == 0  # it waited 2 steps
    assert (c["steps_plain"], c["step_plain_s"]) == (1, 1.0)
    assert (c["steps_loading"], c["step_loading_s"]) == (2, 3.0)
    assert costs.recent_step_s() == 1.0  # only plain steps weigh a load
    tax.finished("a")
    assert not tax.others_running("r")


def test_the_async_tax_counts_the_waits_of_at_most_one_step():
    from gcache.integrations.vllm.kv.async_tax import AsyncTax
    from gcache.integrations.vllm.kv.stats import ConnectorStats

    stats = ConnectorStats()
    tax = AsyncTax(stats, LoadCosts())
    tax.step({"a"}, set(), now=0.0)
    tax.park("q", now=0.5)  # planned while step 2 is scheduled...
    tax.step({"a"}, set(), now=1.0)
    tax.step({"a", "q"}, set(), now=2.0)  # ...and runs in step 3: it waited 1 step
    tax.scheduled("q", now=2.0)
    c = stats.snapshot()
    assert (c["remote_waits"], c["remote_wait_steps"], c["remote_waits_one_step"]) == (1, 1, 1)
