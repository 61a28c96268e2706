"""The async tax, measured on the scheduler side: how long requests wait in vLLM's
WAITING_FOR_REMOTE_KVS after their load between steps was planned (seconds and engine steps),
and how long the steps of other requests take with a load in the step or in flight against
without one. Also who ran in the last step (the load choice asks whether others run) and
the plain step time it weighs a load against.

A step's time is the time between two build_connector_meta calls (one per engine step);
counted only for steps that ran requests other than those loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gcache.integrations.vllm.kv.load_choice import LoadCosts
    from gcache.integrations.vllm.kv.stats import ConnectorStats


class AsyncTax:
    def __init__(self, stats: ConnectorStats, costs: LoadCosts) -> None:
        self.stats = stats
        self.costs = costs
        self.steps = 0  # build_connector_meta calls so far
        self.running: set[str] = set()  # requests the last step scheduled
        self.parked: dict[str, tuple[float, int]] = {}  # in WAITING_FOR_REMOTE_KVS: (since, step)
        self._last_at: float | None = None
        self._last: tuple[bool, bool] = (False, False)  # (ran others, with a load in it or in flight)

    def park(self, req_id: str, now: float) -> None:
        """Its load runs between steps: it waits in WAITING_FOR_REMOTE_KVS from now."""
        self.parked[req_id] = (now, self.steps)

    def step(self, running: set[str], loaders: set[str], now: float) -> None:
        """A step is being scheduled (`running`: its requests; `loaders`: those loading in it):
        the previous step's time is counted."""
        ran_others, loading = self._last
        if self._last_at is not None and ran_others:
            seconds = now - self._last_at
            self.stats.count("steps_loading" if loading else "steps_plain")
            self.stats.count("step_loading_s" if loading else "step_plain_s", seconds)
            if not loading:
                self.costs.observe_step(seconds)
        self._last_at = now
        self.running = running
        self._last = (bool(running - loaders), bool(loaders) or bool(self.parked))
        self.steps += 1

    def scheduled(self, req_id: str, now: float) -> None:
        """The request runs in this step: if it was parked, its wait is counted."""
        parked = self.parked.pop(req_id, None)
        if parked is not None:
            since, step = parked
            self.stats.count("remote_waits")
            self.stats.count("remote_wait_s", now - since)
            waited = self.steps - 1 - step
            self.stats.count("remote_wait_steps", waited)
            self.stats.count("remote_waits_one_step", int(waited <= 1))

    def others_running(self, req_id: str) -> bool:
        return bool(self.running - {req_id})

    def finished(self, req_id: str) -> None:
        self.running.discard(req_id)
        self.parked.pop(req_id, None)
