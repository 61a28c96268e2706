"""The two connectors of one engine that share a process: what the worker's offers its scheduler.

vLLM builds a scheduler-side and a worker-side connector. With its uniproc executor (tensor
parallel size 1: one GPU, or a CPU) both live in the engine-core process, and the scheduler's
prefetch (prefetch.py) can stage values in memory the worker copies from. The worker publishes a
WorkerLink under vLLM's engine id when it registers its KV caches; the scheduler finds it in
the same process or not at all (a worker in another process: no prefetch, the lookup path).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gcache.integrations.vllm.transfer.staging import StagingPool


@dataclass
class WorkerLink:
    alloc_host: Callable[[int], memoryview]  # the worker mover's staging memory (pinned on a GPU)
    value_bytes: dict[int, int]  # per group index: one value's bytes
    segment_spans: dict[int, list[tuple[int, int]]]  # per group index: (offset, length) of its segments
    direct: bool = False  # its loads go from the store's shared memory straight into the blocks
    # Set by the scheduler once its prefetch pool exists: the pool the worker copies staged
    # values from, and how the worker hands their slots back once its copy completed.
    staging: StagingPool | None = None
    give_back: Callable[[list[int]], None] | None = None


_links: dict[str, WorkerLink] = {}
_lock = threading.Lock()


def publish(engine_id: str, link: WorkerLink) -> None:
    with _lock:
        _links[engine_id] = link


def find(engine_id: str) -> WorkerLink | None:
    with _lock:
        return _links.get(engine_id)


def withdraw(engine_id: str, link: WorkerLink) -> None:
    with _lock:
        if _links.get(engine_id) is link:
            del _links[engine_id]
