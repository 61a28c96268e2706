"""The soak's counter check: the connectors' own totals, read exactly from their stats files
(kv_connector_extra_config gcache_stats_dir: <dir>/scheduler.json, <dir>/worker-<rank>.json),
reconciled with the node's counters.

Per value a step's pages offer for saving, exactly one of: saved (the node answered stored or
already there), skipped (the EXISTS probe found it), failed (the node refused it, or the call
failed: "unanswered" when it may have reached the node, "unsent" while the store was suspect),
dropped (a full queue or staging). So, summed over every engine:
  offered = saved + skipped + failed + dropped
  saved = the put calls' values answered yes; failed = answered no + unanswered + unsent
  node puts_stored + puts_exists = saved, node puts_no_space + puts_too_large +
      checksum_failures_put = answered no (the node may also have taken up to `unanswered` more)
  node hits = the get calls' values answered yes, the workers' and the prefetches' (up to
      `unanswered` more); values_loaded = the workers' gets answered yes (one value per page)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

SETTLE_TIMEOUT_S = 180.0
# The counters the check reads: equal in two successive writes of every file = settled.
KEYS = (
    "save_values_offered",
    "values_saved",
    "values_skipped_existing",
    "values_save_failed",
    "save_values_dropped",
    "values_loaded",
    "load_failed_values",
    "prefetch_pages_staged",
    "put_values_answered_yes",
    "put_values_answered_no",
    "put_values_unanswered",
    "put_values_unsent",
    "get_values_answered_yes",
    "get_values_answered_no",
    "get_values_unanswered",
    "get_values_unsent",
)
NODE_KEYS = (
    *("puts_stored", "puts_exists", "puts_no_space", "puts_too_large", "checksum_failures_put"),
    *("hits_memory", "hits_disk", "misses", "evictions_memory"),
)


def stats_dir(engine_dir: Path) -> Path:
    return engine_dir / "gcache-stats"


def _read(d: Path) -> dict[str, dict[str, Any]]:
    """Each half's last record in d: {"scheduler": {...}, "worker-0": {...}}."""
    out = {}
    for f in sorted(d.glob("*.json")):
        try:
            out[f.stem] = json.loads(f.read_text())
        except (OSError, ValueError):  # replaced atomically: only a missing file is possible
            continue
    return out


def read_settled(dirs: list[Path], interval_s: float, timeout_s: float = SETTLE_TIMEOUT_S) -> list[dict]:
    """Per engine {half: counters}, once no worker has saves pending and every file was rewritten
    with the same KEYS as the read before (the last puts are counted). RuntimeError past timeout_s."""
    deadline = time.monotonic() + timeout_s
    before: list[dict[str, dict[str, Any]]] | None = None
    while True:
        now = [_read(d) for d in dirs]
        if before is not None and _settled(before, now):
            return [{half: rec["counters"] for half, rec in engine.items()} for engine in now]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the connectors' stats files did not settle in {timeout_s:.0f}s: {now}")
        before = now
        time.sleep(interval_s * 1.5)


def _settled(before: list[dict], now: list[dict]) -> bool:
    for b, n in zip(before, now):
        if not any(h.startswith("worker") for h in n) or set(b) != set(n):
            return False
        for half, rec in n.items():
            c, old = rec["counters"], b[half]
            if rec["seq"] <= old["seq"] or c.get("saves_pending", 0):
                return False
            if any(c.get(k, 0) != old["counters"].get(k, 0) for k in KEYS):
                return False
    return True


def reconcile(engines: list[dict[str, dict[str, float]]], node: dict[str, int]) -> tuple[dict, list[str]]:
    """The figures, and what does not add up (empty when everything does)."""

    def total(key: str, halves: str = "") -> float:
        return sum(c.get(key, 0) for e in engines for h, c in e.items() if h.startswith(halves))

    c = {k: int(total(k)) for k in KEYS}
    n = {k: int(node.get(k, 0)) for k in NODE_KEYS}
    took = n["puts_stored"] + n["puts_exists"]
    refused = n["puts_no_space"] + n["puts_too_large"] + n["checksum_failures_put"]
    hits = n["hits_memory"] + n["hits_disk"]
    put_lost, get_lost = c["put_values_unanswered"], c["get_values_unanswered"]
    problems = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    accounted = c["values_saved"] + c["values_skipped_existing"] + c["values_save_failed"] + c["save_values_dropped"]
    check(
        c["save_values_offered"] == accounted,
        f"values offered {c['save_values_offered']} != saved + skipped + failed + dropped {accounted}",
    )
    check(
        c["values_saved"] == c["put_values_answered_yes"],
        f"values saved {c['values_saved']} != puts answered yes {c['put_values_answered_yes']}",
    )
    failed_calls = c["put_values_answered_no"] + put_lost + c["put_values_unsent"]
    check(
        c["values_save_failed"] == failed_calls,
        f"values failed {c['values_save_failed']} != puts answered no + unanswered + unsent {failed_calls}",
    )
    extra_took, extra_refused = took - c["values_saved"], refused - c["put_values_answered_no"]
    check(
        0 <= extra_took and 0 <= extra_refused and extra_took + extra_refused <= put_lost,
        f"the node took {took} and refused {refused} values; the connectors saved {c['values_saved']}, "
        f"were refused {c['put_values_answered_no']}, {put_lost} unanswered",
    )
    extra_hits = hits - c["get_values_answered_yes"]
    check(
        0 <= extra_hits <= get_lost,
        f"the node hit {hits} values; the connectors' gets found {c['get_values_answered_yes']}, {get_lost} unanswered",
    )
    worker_found = int(total("get_values_answered_yes", "worker"))
    check(
        c["values_loaded"] == worker_found,
        f"values loaded {c['values_loaded']} != the workers' gets answered yes {worker_found}",
    )
    figures = dict(
        connector=c,
        node=n,
        saved_vs_node=[c["values_saved"], took],
        refused_vs_node=[c["put_values_answered_no"], refused],
        found_vs_node_hits=[c["get_values_answered_yes"], hits],
    )
    return figures, problems
